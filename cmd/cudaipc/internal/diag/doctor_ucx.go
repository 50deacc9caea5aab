package diag

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/cudaipc/cudaipc/transport/ucx"
)

// ucxCheck says whether this machine can join a cluster of daemons over
// UCX, which libucp is in use and why it was chosen, and how GPU objects
// cross nodes with it: registered directly where UCX reports a CUDA memory
// type, else staged through pinned host memory (docs/cluster.md, "GPU
// objects and fan-out"). lib is --ucx-lib, "" for none.
func ucxCheck(lib string) (name, status, detail string) {
	name = "ucx"
	why := "the default " + ucx.DefaultLibrary + " on the loader's path"
	switch {
	case lib != "":
		if err := ucx.SetLibrary(lib); err != nil {
			return name, "fail", "--ucx-lib: " + err.Error()
		}
		why = "--ucx-lib"
	case os.Getenv(ucx.EnvLibrary) != "":
		why = "$" + ucx.EnvLibrary
	}
	r := ucx.Probe()
	if r.Err != nil {
		if errors.Is(r.Err, ucx.ErrNotFound) {
			return name, "warn", fmt.Sprintf("%v (%s chosen by %s): this daemon can run single-node only", r.Err, r.Library, why)
		}
		return name, "warn", fmt.Sprintf("UCX from %s (chosen by %s) does not work: %v; this daemon runs single-node", r.Library, why, r.Err)
	}
	var res []string
	for _, x := range r.Resources {
		res = append(res, x.String())
	}
	gpu := "GPU objects: the staging path (holders checksum an object on its GPU, publish it, then copy it device→host into a pinned buffer registered with UCX, readers' fetches waiting for the slices not copied yet; readers land chunks in pinned memory, copy them host→device and check them on their GPU), since this UCX registers host memory only; a UCX built with CUDA, given with the ucx-lib setting, registers GPU arenas directly"
	if r.CanRegisterCUDA() {
		gpu = "GPU objects: holders register GPU arenas with UCX directly (UCX reports CUDA memory; GPUDirect RDMA where UCX_TLS and the NIC allow); readers land chunks in pinned memory, copy them host→device and check them on their GPU"
	}
	reads := "reads: fetches (the holder sends the bytes of an exposure's window by UCX rendezvous; a daemon that reads so answers no GETs, which over tcp UCX would answer for any address); a daemon of experimental-cluster-read = get reads with, and answers, GETs"
	return name, "ok", fmt.Sprintf("UCX %s from %s (chosen by %s); transports %s; %s; %s", r.Version, r.Library, why, strings.Join(res, " "), gpu, reads)
}
