#!/usr/bin/env bash
# The IPC benchmark, side by side: cudaipc (Go), the same calls in C against
# the driver API, PyTorch and CuPy, and the in-process copy as the hardware
# reference. Runs on the GPU machine, from the repository root, after
# scripts/gpu-build.sh (which puts this directory at .gpu/bench and the CLI
# at .gpu/bin/cudaipc). Raw JSON and logs go to $OUT/bench (or /tmp/gpu-out/bench);
# the table is printed last.
#
#   bash .gpu/bench/run-gpu.sh                      # 1 GiB large buffer, 200 latency reps, 20 copy reps
#   SIZE=4294967296 ITERS=200 BW_ITERS=20 bash .gpu/bench/run-gpu.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/gpu-out}/bench; mkdir -p "$out"
size=${SIZE:-1073741824}; iters=${ITERS:-200}; bw=${BW_ITERS:-20}
export PYTHONUNBUFFERED=1
for f in "$here"/../bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done # gpu-build.sh compresses them
# NVLink multicast must stay off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t_start=$SECONDS
step() { echo "== $* ($((SECONDS - t_start)) s)"; }

nvidia-smi --query-gpu=index,name,uuid,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$out/nvidia-smi.txt"
nvidia-smi topo -m >"$out/topo.txt" 2>&1

step "cudaipc bench ipc"
timeout 100 "$here/../bin/cudaipc" bench ipc --size "$size" --iters "$iters" --bw-iters "$bw" --json \
  >"$out/go.json" 2>"$out/go.log" || { echo "cudaipc bench ipc failed (rc $?):"; tail -5 "$out/go.log"; }

step "C driver API (ipc_bench.c)"
cbin=/tmp/cudaipc-ipc_bench
cuda=${CUDA_HOME:-/usr/local/cuda}
# The toolkit's stub libcuda.so to link; at run time the driver's libcuda.so.1.
if gcc -O2 -Wall -I"$cuda/include" "$here/ipc_bench.c" -o "$cbin" \
     -L"$cuda/lib64/stubs" -L"$cuda/targets/x86_64-linux/lib/stubs" -lcuda >"$out/c-build.log" 2>&1 ||
   gcc -O2 -Wall -I"$cuda/include" "$here/ipc_bench.c" -o "$cbin" \
     -L/usr/local/nvidia/lib64 -L/lib/x86_64-linux-gnu -l:libcuda.so.1 >>"$out/c-build.log" 2>&1 ||
   nvcc -O2 "$here/ipc_bench.c" -o "$cbin" -L"$cuda/lib64/stubs" -lcuda >>"$out/c-build.log" 2>&1; then
  timeout 40 "$cbin" --size "$size" --iters "$iters" >"$out/c.json" 2>"$out/c.log" ||
    { echo "ipc_bench failed (rc $?):"; tail -5 "$out/c.log"; }
else
  echo "ipc_bench.c did not compile:"; tail -20 "$out/c-build.log"
fi

step "PyTorch (torch.multiprocessing)"
timeout 120 python3 "$here/torch_ipc.py" --what torch --size "$size" --iters "$iters" --bw-iters "$bw" \
  >"$out/torch.json" 2>"$out/torch.log" || { echo "torch_ipc.py --what torch failed (rc $?):"; tail -15 "$out/torch.log"; }

step "CuPy (cupy.cuda.runtime.ipc*)"
timeout 45 python3 "$here/torch_ipc.py" --what cupy --size "$size" --iters "$iters" \
  >"$out/cupy.json" 2>"$out/cupy.log" || { echo "torch_ipc.py --what cupy failed (rc $?):"; tail -15 "$out/cupy.log"; }

step "done; raw JSON and logs in $out"
python3 "$here/compare.py" --markdown "$out"/{go,c,torch,cupy}.json >"$out/compare.md"
python3 "$here/compare.py" "$out"/{go,c,torch,cupy}.json | tee "$out/compare.txt"
