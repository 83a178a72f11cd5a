"""Where a fencer's OpenTelemetry metrics and spans go (docs/observability.md lists them)::

telemetry = sa_fence.telemetry.Telemetry(meter_provider=meters, tracer_provider=tracers)
fencer = sa_fence.Fencer(redis_client, engine, telemetry=telemetry)
"""

from ._telemetry import Telemetry, default_name_pattern

__all__ = ["Telemetry", "default_name_pattern"]
