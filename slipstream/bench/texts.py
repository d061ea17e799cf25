"""The benchmark's built-in text set, written for this project (no downloads, no licensed corpora).

``CORPUS`` is technical prose about serving language models; documents for ``batch-docs``, the
``builtin`` serving dataset and the vocabulary of random-word prompts are all cut from it.
"""
from __future__ import annotations

CORPUS = """\
A language model produces text one token at a time. Each new token depends on every token before it, \
so the model cannot simply compute the whole answer in parallel. The work splits into two phases with \
very different costs. During prefill the server reads the whole prompt at once and fills the attention \
cache; this phase is dominated by large matrix products and keeps the arithmetic units busy. During \
decode the server produces one token per step, and each step must read every weight of the model from \
memory to compute a single row of activations. For small batches the decode phase is limited by memory \
bandwidth rather than by arithmetic.

The attention cache stores the keys and values of every previous position for every layer. Its size \
grows linearly with the length of the conversation and with the number of concurrent requests. A naive \
server reserves one contiguous buffer per request for the longest possible sequence, which wastes most \
of the memory on space that is never used. Paged attention divides the cache into fixed-size blocks and \
keeps a small table per sequence that maps logical positions to physical blocks. Blocks are taken from a \
free list when a sequence grows and returned when it finishes, so fragmentation stays low and many more \
requests fit on the same device.

Continuous batching changes the unit of scheduling from the request to the step. Instead of waiting for \
a whole batch of requests to finish before admitting new ones, the scheduler revisits the batch after \
every decode step. Finished sequences leave immediately and waiting requests join as soon as there is \
room in the cache. The result is a much higher utilisation of the hardware when requests have different \
lengths, which is the normal case for a public endpoint. The cost is a more complex scheduler that must \
decide, at every step, how much prefill work to mix with the ongoing decode work.

Chunked prefill is one answer to that decision. A long prompt is cut into pieces of a few hundred \
tokens, and each piece is processed together with the decode tokens of the other requests. This keeps \
the time of every step bounded, so a single very long prompt does not freeze the output of everyone else. \
The chunk size is a trade-off: larger chunks use the hardware more efficiently, while smaller chunks \
give smoother inter-token latency to the requests that are already streaming.

Quantization reduces the number of bytes that each decode step must read. Weights stored as eight-bit \
or four-bit integers with a scale per small group take a half or a quarter of the memory of sixteen-bit \
floats. Because decode is bound by memory bandwidth, fewer bytes translate almost directly into more \
tokens per second. The kernels must unpack the integers and apply the scales inside the registers, \
without writing the expanded weights back to memory, or the saving disappears. Accuracy is usually \
preserved when the groups are small and the outliers are handled with care.

Speculative decoding attacks the sequential nature of generation. A cheap draft proposes several tokens \
ahead, and the large model verifies all of them in one forward pass, which costs about as much as \
producing a single token. When the draft is right, several tokens are accepted at once; when it is \
wrong, the rejected tokens are discarded and their cache entries are rolled back. The draft can be a \
small model, extra prediction heads trained with the main model, or a simple lookup of repeated phrases \
in the prompt. The speed-up depends entirely on how often the guesses are accepted.

Launch overhead matters more than many people expect. A transformer layer consists of a dozen separate \
operations, and a model with thirty layers issues hundreds of small kernels per token. On a fast \
accelerator each kernel may finish in a few microseconds, so the time spent launching them and \
synchronising with the host becomes a large fraction of the step. Capturing the whole step as a graph \
and replaying it removes most of that overhead. A persistent kernel goes further: one program stays \
resident on every processor and pulls tasks from a queue, so no launch happens between operators.

Measuring speed honestly is harder than it looks. The time to the first token includes the queueing \
delay, the prefill of the prompt and the network. The time per output token describes how fast the \
text streams once it has started. Throughput counts all the tokens produced by all the requests in a \
period of time, and it can rise while the experience of each individual user gets worse. A fair \
comparison runs the same workload against every system on the same machine, reports percentiles \
rather than only averages, and states the configuration of each peer.

Tokenizers turn text into the integer sequences that the model reads. Byte pair encoding starts from \
single bytes and repeatedly merges the most frequent adjacent pairs into new symbols, so common words \
become one token while rare words are split into pieces. The same sentence can therefore have very \
different token counts in different models. Detokenization must be incremental when streaming, because \
a single character may be spread over several tokens and must not be shown until it is complete.

Serving a model to many users also requires careful control of memory. When the cache is full, the \
scheduler must either stop admitting requests, evict the cache of a waiting request and recompute it \
later, or move it to host memory. Prefix caching keeps the cache of shared prompt prefixes, such as a \
long system message, and reuses it across requests. A radix tree over token sequences finds the longest \
cached prefix quickly, and a least recently used policy decides which blocks to drop under pressure.

Mixture of experts models replace each dense feed-forward block with many smaller experts and a router \
that sends every token to a few of them. The model holds far more parameters than it uses for any one \
token, which improves quality at a fixed cost per token. For serving, the challenge moves to memory \
capacity and to the communication needed when the experts are spread over several devices. Grouping \
the tokens by expert before the matrix products keeps the kernels efficient even at small batch sizes.
"""

# short scenario: "write a 200-character commentary"-style prompts
SHORT_TOPICS = [
    "trends in artificial intelligence development",
    "the energy cost of training large models",
    "open-source language models",
    "AI assistants for software engineers",
    "the future of on-device inference",
    "benchmarks for language models",
    "AI in scientific research",
    "the speed of chatbots",
]

# long scenario: "a 3,000-character technical article"
LONG_TOPICS = [
    "the acceleration of large language model inference",
    "memory management in LLM serving systems",
    "speculative decoding and its trade-offs",
    "quantization of neural network weights for fast inference",
]

# conversation scenario: a 10-round technical Q&A
CONVERSATION = [
    "What is the difference between prefill and decode in LLM inference?",
    "Why is decode usually limited by memory bandwidth?",
    "How does a KV cache work, and how much memory does it need?",
    "What problem does paged attention solve?",
    "Explain continuous batching in a few sentences.",
    "How does chunked prefill help latency?",
    "What does 4-bit weight quantization change for decode speed?",
    "How does speculative decoding keep the output identical?",
    "Why do CUDA graphs reduce the time per token?",
    "Summarize the three most important ideas from this conversation.",
]

SYSTEM_PROMPT = "You are a concise and accurate technical assistant."
