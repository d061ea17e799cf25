"""Serving beyond one engine: replicas on Ray Serve behind one endpoint, and tensor/expert
parallelism over torch.distributed.

    router.py           which replica a request goes to (cache-aware, round-robin, least-loaded)
    prompt_key.py       a request body -> the chained KV-block hashes of its prompt (as the engine's
                        prefix cache computes them)
    asgi_call.py        one HTTP request through an ASGI app in process, its response as parts
    replica.py          the Ray Serve deployment: one engine and the single server's app
    ingress.py          the one endpoint: guard, routing, proxying, retries, /health, /metrics
    metrics.py          replicas' Prometheus texts -> one text (per-replica labels plus totals)
    ray_serve.py        `slipstream serve --replicas N`: the Ray cluster, the deployments, the ingress
    tensor_parallel.py  `--tensor-parallel N`: each rank's shard cut from the loader's weights, the
                        model's own step over it with the collectives added (Llama family) or a
                        sharded forward (DeepSeek family); the backend/device per rank (gloo on the
                        CPU, NCCL on cuda:LOCAL_RANK); rank 0's model for the engine, `follow` for the rest
    tp_launch.py        the group: this process as rank 0, ranks 1..N-1 spawned, the LLM over the shards
    tp_rss.py           `python -m slipstream.distributed.tp_rss`: peak and steady RSS of each rank

Nothing here is imported by `slipstream`, the engine or the server: Ray is needed only to serve
replicas (`pip install slipstream[distributed]`). docs/DISTRIBUTED.md describes both.
"""
