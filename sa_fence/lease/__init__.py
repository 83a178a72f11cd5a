"""The lease in Redis: the sans-I/O protocol (:mod:`.protocol`), the Redis
client's checks (:mod:`.redis_client`), the lifecycle both front ends share
(:mod:`.lifecycle`), and the two front ends, :class:`~sa_fence.Fencer`
(:mod:`.sync`) and :class:`~sa_fence.AsyncFencer` (:mod:`.aio`).
"""
