#!/bin/sh
# The newest Python 3.12 or later on this machine, as the absolute path of
# its interpreter, or nothing (exit 1). jax 0.11 and later need Python 3.12:
# the Makefile builds the main venv with this Python so that the suite runs
# on the newest jax. Looks on PATH (python3.N), then among pyenv's versions
# (whose shims on PATH run only the selected version); a candidate counts
# only if it runs.
for minor in 20 19 18 17 16 15 14 13 12; do
  version=""
  if command -v pyenv >/dev/null 2>&1; then
    version=$(pyenv versions --bare 2>/dev/null |
      grep -E "^3\.$minor(\.[0-9]+)?$" | sort -t. -k3,3n | tail -n 1)
  fi
  for candidate in "$(command -v "python3.$minor" 2>/dev/null)" \
    "$(test -n "$version" &&
      PYENV_VERSION=$version pyenv which "python3.$minor" 2>/dev/null)"; do
    [ -n "$candidate" ] || continue
    if path=$("$candidate" -c 'import sys; print(sys.executable)' 2>/dev/null)
    then
      echo "$path"
      exit 0
    fi
  done
done
exit 1
