"""Where a fencer's OpenTelemetry metrics and spans go.

Fencers report to the global providers until told otherwise; a
:class:`Telemetry` names others, or how lease names are shortened::

    from sa_fence.telemetry import Telemetry

    telemetry = Telemetry(meter_provider=meters, tracer_provider=tracers)
    fencer = sa_fence.Fencer(redis_client, engine, telemetry=telemetry)

docs/observability.md lists every metric, span and log field.
"""

from ._telemetry import Telemetry, default_name_pattern

__all__ = ["Telemetry", "default_name_pattern"]
