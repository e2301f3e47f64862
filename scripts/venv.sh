# Sourced by scripts/serve and scripts/test: makes .venv (if missing) and installs the project into it.
# EXTRAS selects the optional dependency groups, e.g. EXTRAS=dev.
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${EXTRAS:+[$EXTRAS]}"
