#!/usr/bin/env bash
# The device-to-device check, for a session that is lent a GPU machine (see docs/connectors.md, "CUDA tensors").
# There, python3 holds a CUDA build of torch but not pyzmq: carry its wheel in .whl (Python 3.12), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl pyzmq
# then run this script with .whl carried. It prints the CUDA tests' result and, for a 256 MiB CUDA
# tensor between two processes, GB/s against a device-to-device copy_ measured in the same run:
# once mapped in place (the default) and once cloned on the consumer's device (copy_on_get).
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_shared_memory.py tests/test_codec.py -k "cuda" || true
for config in '{}' '{"copy_on_get": true}'; do
    python3 -m omni_mesh.cli bench connector --device cuda --sizes 16MiB,256MiB --no-raw --config "$config"
done
