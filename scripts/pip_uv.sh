# Sourced by scripts/setup*.sh: `uv_pip VENV ARGS...` installs into VENV with uv (a pinned release from PyPI,
# put into VENV by pip first): resolution, downloads and unpacking in parallel and in Rust, one wheel cache
# (~/.cache/uv) shared by the three environments, so torch's CPU wheel is unpacked once and linked after.
# --compile-bytecode: Python writes no .pyc where PYTHONDONTWRITEBYTECODE is set (as on this machine), so an
# environment installed without them would compile torch's and transformers' sources in every process that
# imports them; pip compiles by default, uv only when asked.
# The CPU torch wheel comes from pip's find-links (PIP_FIND_LINKS or pip's config, as pip would take it):
# uv reads no pip configuration, so they are handed over here.
UV_VERSION=0.13.9
uv_pip() {
  local venv=$1
  shift
  if [ ! -x "$venv/bin/uv" ] || [ "$("$venv/bin/uv" --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    "$venv/bin/python" -m pip install -q "uv==$UV_VERSION"
  fi
  local links=() l
  for l in ${PIP_FIND_LINKS:-$("$venv/bin/python" -m pip config get global.find-links 2>/dev/null || true)}; do
    links+=(--find-links "$l")
  done
  "$venv/bin/uv" pip install -q --python "$venv/bin/python" ${links[@]+"${links[@]}"} "$@"
}
