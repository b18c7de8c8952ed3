#!/usr/bin/env bash
# Installs the llama.cpp test tier (tests/llamacpp/): llama.cpp's `llama-server`, built from the
# llama.cpp tree vendored in llama-cpp-python's source package on PyPI, and two GGUF files
# written from the vLLM tier's random-weight models (.cache/llamacpp/tiny.gguf, slow.gguf;
# .cache/llamacpp/llama-server links to the binary).
# Idempotent: a second run takes under a second. Its last line says what it did, or why it
# could not ("llamacpp tier: skipped: ..."): then the reason is in .cache/llamacpp.unavailable
# for the tests' skip, and it exits 0.
#
# The build is cached outside the checkout, so that the next CI run on this machine (a fresh
# clone) does not build again (~500 s on two cores): in
#   ${XDG_CACHE_HOME:-~/.cache}/ralph-run/llama-server-VERSION-STAMP/
# STAMP names the build's flags: other flags, another directory. The directories are made 0700
# and must be ours (not a link, owned by us, no one else may write): a binary we run is never
# taken from a place another user could have made. LLAMACPP_CACHE chooses another directory.
# What the cache holds: bin/llama-server (static: no libllama.so beside it), the tree's
# converter (convert_hf_to_gguf.py, conversion/, gguf-py/) for the GGUF files, and .built.
#
# Facts this script works around (llama-cpp-python 0.3.36's sdist, cmake 3.25, g++ 12):
# - only the `llama-server` target is built (-j 2: ~500 s here); no libcurl or OpenSSL (no
#   model download, plain HTTP on loopback), no native CPU flags (the cache may serve another
#   CPU of the same machine type);
# - the converter refuses the tiny models' tokenizer ("BPE pre-tokenizer was not recognized":
#   it is trained by make_tiny_model.py); ci/make_tiny_gguf.py names it `gpt-2` (byte-level
#   BPE), with the vLLM tier's python (torch, transformers): this script waits for that tier's
#   models (ci/install-vllm.sh, run beside it by .ci/run) up to LLAMACPP_WAIT_MODELS seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=$root/.cache
out=$cache/llamacpp
unavailable=$cache/llamacpp.unavailable
log=$cache/install-llamacpp.log
version=0.3.36
vllm_python=$cache/vllm-venv/bin/python
generator=$root/runbooks/vllm-local/make_tiny_model.py
converter=$root/ci/make_tiny_gguf.py
wait_models=${LLAMACPP_WAIT_MODELS:-1800}
jobs=${LLAMACPP_JOBS:-2}
flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF)
command -v ninja >/dev/null || flags=("${flags[@]:2}") # make, then

hash_of() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }
stamp=$(echo "$version ${flags[*]}" | sha256sum | cut -c1-12)
base=${LLAMACPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ralph-run}
build=$base/llama-server-$version-$stamp
server=$build/bin/llama-server
tree=$build/convert # the converter's part of the llama.cpp tree

mkdir -p "$cache"
: >"$log"

give_up() { # one line, a reason the tests can show, exit 0: the tier is skipped, not failed
  echo "$1" >"$unavailable"
  echo "llamacpp tier: skipped: $1"
  exit 0
}

# A directory of ours: made 0700 if missing; else not a link, owned by us, writable by no one
# else. The reason on stdout when it is not.
own_dir() {
  local dir=$1 owner mode
  [[ -e $dir || -L $dir ]] || mkdir -m 700 -p "$dir" 2>/dev/null || { echo "cannot make $dir"; return 1; }
  [[ ! -L $dir && -d $dir ]] || { echo "$dir is not a directory of its own (a link?)"; return 1; }
  read -r owner mode < <(stat -c '%u %a' "$dir")
  [[ $owner == "$(id -u)" ]] || { echo "$dir belongs to uid $owner, not to us"; return 1; }
  ((8#$mode & 8#022)) && { echo "$dir is writable by others (mode $mode)"; return 1; }
  return 0
}

built_ok() { [[ -x $server && -f $build/.built && $(cat "$build/.built") == "$stamp" ]]; }
models_ok() {
  local want
  want="$(model_stamp)"
  [[ -f $out/.made && $(cat "$out/.made") == "$want" && -s $out/tiny.gguf && -s $out/slow.gguf ]]
}
# what the GGUF files are made of: the converter, the tree, the vLLM tier's models
model_stamp() { echo "$version $(hash_of "$converter") $(hash_of "$generator")"; }
vllm_models_ok() { # as ci/install-vllm.sh stamps them
  local want
  want=$(hash_of "$generator")
  [[ -x $vllm_python ]] &&
    for model in tiny-model slow-model; do
      [[ -f $cache/$model/.made && $(cat "$cache/$model/.made") == "$want" ]] || return 1
    done
}

for dir in "$(dirname "$base")" "$base"; do
  [[ $dir == "$(dirname "$base")" && -d $dir ]] && continue # ~/.cache itself: made by others' tools too
  why=$(own_dir "$dir") || give_up "the build cache: $why"
done
[[ -e $build ]] && { why=$(own_dir "$build") || give_up "the build cache: $why"; }

if built_ok && models_ok; then
  rm -f "$unavailable"
  ln -sfn "$server" "$out/llama-server"
  echo "llamacpp tier: cached (llama-server $version in $build, models in .cache/llamacpp)"
  exit 0
fi

start=$SECONDS
rm -f "$unavailable"
did=()
if ! built_ok; then
  for tool in cmake c++; do
    command -v "$tool" >/dev/null || give_up "no $tool here to build llama-server"
  done
  work=$(mktemp -d "${TMPDIR:-/tmp}/install-llamacpp.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  # the source package only, never built by pip (pip prepares its metadata: ~30 s)
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" \
    -d "$work" >>"$log" 2>&1 ||
    give_up "cannot download llama-cpp-python==$version's source package (see $log)"
  tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work" >>"$log" 2>&1 ||
    give_up "cannot unpack llama-cpp-python==$version's source package (see $log)"
  source=$work/llama_cpp_python-$version/vendor/llama.cpp
  rm -rf "$build"
  why=$(own_dir "$build") || give_up "the build cache: $why"
  if ! cmake -S "$source" -B "$work/build" "${flags[@]}" >>"$log" 2>&1; then
    rm -rf "$build"
    give_up "cmake could not configure llama.cpp's tree (see $log)"
  fi
  built=$SECONDS
  if ! cmake --build "$work/build" --target llama-server -j "$jobs" >>"$log" 2>&1; then
    rm -rf "$build"
    give_up "llama-server did not build (see $log)"
  fi
  mkdir -p "$build/bin"
  cp "$work/build/bin/llama-server" "$server"
  mkdir -p "$tree"
  cp -r "$source/convert_hf_to_gguf.py" "$source/conversion" "$source/gguf-py" "$tree/"
  if ! "$server" --version >>"$log" 2>&1; then
    rm -rf "$build"
    give_up "the llama-server built does not run here (see $log)"
  fi
  echo "$stamp" >"$build/.built"
  did+=("built llama-server in $((SECONDS - built)) s")
  rm -rf "$work"
  trap - EXIT
fi

if ! models_ok; then
  # the vLLM tier makes the models (with its python): wait for it, or for its reason
  waited=$SECONDS
  until vllm_models_ok; do
    [[ -f $cache/vllm-venv.unavailable ]] &&
      give_up "no python with torch to write the GGUF files: vLLM tier: $(cat "$cache/vllm-venv.unavailable")"
    ((SECONDS - waited < wait_models)) ||
      give_up "the vLLM tier's models (.cache/tiny-model) did not come within ${wait_models} s (ci/install-vllm.sh)"
    sleep 2
  done
  rm -rf "$out"
  mkdir -p "$out"
  for model in tiny slow; do
    "$vllm_python" "$converter" "$tree" "$cache/$model-model" "$out/$model.gguf" >>"$log" 2>&1 ||
      give_up "the GGUF converter failed on .cache/$model-model (see $log)"
  done
  model_stamp >"$out/.made"
  did+=("wrote .cache/llamacpp/tiny.gguf ($(du -h "$out/tiny.gguf" | cut -f1)) and slow.gguf ($(du -h "$out/slow.gguf" | cut -f1))")
fi
ln -sfn "$server" "$out/llama-server" # where the tests and the runbook's comment find it
summary=$(printf '; %s' "${did[@]}")
echo "llamacpp tier: ready in $((SECONDS - start)) s: llama-server $version in $build$summary"
