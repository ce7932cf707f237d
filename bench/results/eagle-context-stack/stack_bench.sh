#!/bin/bash
# usage: stack_bench.sh CODE_DIR NAME  -- verifier + eagle drafter + router from CODE_DIR on loopback, then specdec bench.
set -u
CODE=$1; NAME=$2; OUT=/work/runs/s19/stack; mkdir -p $OUT
PY=/work/main/.venv/bin/python
free() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
V=$(free); D=$(free); G=$(free); H=$(free)
cd $CODE
export HF_HUB_OFFLINE=1
$PY -m verifier_service --model smollm2-135m --port $V --torch-threads 1 > $OUT/$NAME-verifier.log 2>&1 & VP=$!
$PY -m drafter_service --kind eagle --target smollm2-135m --draft-model /work/runs/s19/head --port $D --torch-threads 1 > $OUT/$NAME-drafter.log 2>&1 & DP=$!
sleep 20
$PY -m router --model smollm2-135m --verifier 127.0.0.1:$V --drafter 127.0.0.1:$D --grpc-port $G --http-port $H > $OUT/$NAME-router.log 2>&1 & RP=$!
sleep 12
cd /work/main
timeout 900 .venv/bin/specdec bench --router 127.0.0.1:$G --base-url http://127.0.0.1:$H --concurrency 1 --num-requests 6 --warmup 1 \
  --categories long-context --sweep-speculation off,sequential,auto --drafter eagle --num-draft-tokens 3 --max-tokens 32 \
  --temperature 0 --result-dir $OUT/$NAME --name $NAME --no-plots --no-progress > $OUT/$NAME-bench.log 2>&1
echo "bench rc $?"
kill $RP $DP $VP; wait
