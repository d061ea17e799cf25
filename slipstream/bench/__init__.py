"""`slipstream bench`: the project's speed scenarios and a serving benchmark against any
OpenAI-compatible endpoint, with peers (llama.cpp) side by side.

    metrics.py    the maths (TTFT, TPOT, ITL, goodput, percentiles), pure functions
    client.py     asyncio + httpx streaming client, our own SSE parser, run loops
    workloads.py  scenarios and prompts (texts.py: the built-in text set)
    runner.py     one target: warm-up, timed runs, token counts, summaries
    peers.py      starting/stopping peer servers (llama.cpp) and `slipstream serve`
    report.py     ratios, terminal table, JSON, markdown + PNG plots
    cli.py        `add_parser(subparsers)` / `run(args)`; `python -m slipstream.bench`
"""
