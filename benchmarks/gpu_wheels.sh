#!/bin/bash
# The wheels that the GPU machine's image lacks, downloaded here into .whl/ (ignored by git) so
# that a GPU call can carry them: that machine reaches no package registry. benchmarks/gpu.sh
# installs them first when .whl/ is there.
#
# The image (Python 3.12, CUDA 13) already holds jax, flax, transformers, tokenizers, torch,
# triton, numpy, safetensors, orbax-checkpoint, jinja2, tqdm, uvloop, httpx, h11, anyio, click,
# attrs, msgpack, prometheus-client, huggingface-hub and annotated-doc. Of pyproject.toml's
# dependencies it lacks fastapi, uvicorn, httptools, pyzmq, llguidance and jsonschema; below are
# those and what they need that the image lacks too (starlette, pydantic and opentelemetry-api
# for fastapi, jsonschema's referencing and rpds-py), plus xgrammar (the default grammar backend, which
# imports the image's torch) and its apache-tvm-ffi. Versions: the ones the CPU suite runs with.
# typing-extensions rides along because pydantic needs a recent one.
#   bash benchmarks/gpu_wheels.sh          # PY=python3 by default (any Python with pip)
# Each wheel is fetched on its own (--no-deps), so one that is missing does not stop the rest;
# the script ends with the folder's size, which must stay well under the 64 MiB a call carries.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEST=.whl
WHEELS="
fastapi==0.165.0
opentelemetry-api==1.45.3
starlette==1.10.0
pydantic==2.14.4
pydantic-core==2.50.5
annotated-types==0.8.0
typing-inspection==0.4.5
typing-extensions==4.16.0
uvicorn==0.55.0
httptools==0.9.0
pyzmq==27.3.0
llguidance==1.9.1
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
referencing==0.37.0
rpds-py==2026.9.1
xgrammar==0.2.9
apache-tvm-ffi==0.1.15.post2
"
PLATFORMS=""
for tag in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
    manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS="$PLATFORMS --platform $tag"
done
mkdir -p "$DEST"
failed=0
for spec in $WHEELS; do
    name=${spec%%==*}
    # One version of each: pip install stops on two. Drop other versions left by older lists.
    stem=$(echo "$name" | tr '-' '_')
    for old in "$DEST"/"$stem"-*.whl; do
        [ -e "$old" ] || continue
        case $(basename "$old") in "$stem-${spec#*==}-"*) ;; *) rm -f "$old" ;; esac
    done
    # shellcheck disable=SC2086
    if ! $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $PLATFORMS -d "$DEST" "$spec" 2>&1 | grep -v "^WARNING"; then
        :
    fi
    ls "$DEST"/"$stem"-"${spec#*==}"-*.whl > /dev/null 2>&1 || { echo "MISSING $spec"; failed=1; }
done
ls -1 "$DEST"
echo "$(du -sh "$DEST" | cut -f1) in $DEST ($(ls "$DEST"/*.whl | wc -l) wheels)"
exit $failed
