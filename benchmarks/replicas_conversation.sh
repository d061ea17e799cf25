#!/bin/bash
# issue 16 bench: the conversation scenario against `serve --replicas 2`, once per routing policy
# usage: OUT=dir bash benchmarks/replicas_conversation.sh   (needs the distributed extra: Ray Serve)
mkdir -p "${OUT:-/tmp/replicas-bench}"
cd "$(dirname "$0")/.."
for policy in cache-aware round-robin least-loaded; do
  port=$((8900 + RANDOM % 50))
  .venv/bin/python -m slipstream serve --replicas 2 --router $policy --port $port --no-access-log > ${OUT:-/tmp/replicas-bench}/serve-$policy.log 2>&1 &
  pid=$!
  for i in $(seq 1 300); do
    if curl -s localhost:$port/health | grep -q '"replicas_ready":2'; then break; fi
    sleep 1
  done
  .venv/bin/python -m slipstream bench --base-url http://127.0.0.1:$port --scenario conversation --no-progress \
      --label "replicas2-$policy" --out ${OUT:-/tmp/replicas-bench}/conversation-$policy.json > ${OUT:-/tmp/replicas-bench}/bench-$policy.log 2>&1
  curl -s localhost:$port/health > ${OUT:-/tmp/replicas-bench}/health-$policy.json
  curl -s localhost:$port/metrics > ${OUT:-/tmp/replicas-bench}/metrics-$policy.txt
  kill -INT $pid
  wait $pid
done
echo done > ${OUT:-/tmp/replicas-bench}/DONE
