# Source me: creates .venv from pyproject.toml, at the versions of constraints.txt, if it is
# missing or either file changed, then activates it. Idempotent: a second call with nothing
# changed installs nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.laplace-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -d' ' -f1)"
# LAPLACE_INSTALL_SECONDS: how long this call's install took (0: nothing to do), for the quick
# start's table of stage times.
LAPLACE_INSTALL_SECONDS=0
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[env] creating $VENV from pyproject.toml and constraints.txt (a few minutes the first time)" >&2
  _t0=$SECONDS
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test,lm,lora]" -c "$ROOT/constraints.txt" >&2
  echo "$WANT" > "$STAMP"
  LAPLACE_INSTALL_SECONDS=$((SECONDS - _t0))
fi
export LAPLACE_INSTALL_SECONDS
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
