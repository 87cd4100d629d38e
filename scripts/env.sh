# Source me: creates .venv from pyproject.toml if it is missing or pyproject changed, then
# activates it. Idempotent: a second call with nothing changed installs nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.laplace-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[env] creating $VENV from pyproject.toml (a few minutes the first time)" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test,lm]" >&2
  echo "$WANT" > "$STAMP"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
