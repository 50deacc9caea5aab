// Package ucx is the raw layer over UCX's UCP API (libucp.so.0), loaded at
// run time with purego so that the module builds and tests with
// CGO_ENABLED=0 and runs on machines without UCX (every call then returns
// an error matching ErrNotFound). Functions are named after the C calls
// without the "ucp_" prefix (ucp_worker_create is WorkerCreate) and return
// Go errors (*Error wrapping a Status) instead of ucs_status_t. Besides
// internal/cu this is the only package of the module that uses unsafe or
// purego for a native library; the typed package transport/ucx sits on it.
//
// Parameter structs are Go structs laid out like the C ones of UCX 1.13
// and 1.16 (ucp.h, ucp_def.h: every offset this package sets is the same
// in both, see layout_test.go) and followed by zeroed slack, so that a
// newer library reading a longer struct finds zeros. Every struct is
// passed with a field_mask naming exactly the fields set.
//
// Thread safety is the caller's: this package adds no locks. A worker and
// everything made on it (endpoints, rkeys, requests) must be used by one
// thread at a time (UCS_THREAD_MODE_SERIALIZED), except WorkerSignal.
package ucx

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/ebitengine/purego"

	"github.com/cudaipc/cudaipc/internal/dl"
)

// DefaultLibrary is the versioned soname of UCP. The unversioned libucp.so
// comes with the development package only, so it is never the default.
const DefaultLibrary = "libucp.so.0"

// EnvLibrary names the environment variable that overrides the library path.
const EnvLibrary = "CUDAIPC_LIBUCP"

// EnvErrorSignals is UCX's setting of the signals it takes over. libucs
// reads it when it is loaded and, by default, installs its own SIGSEGV,
// SIGBUS, SIGILL and SIGFPE handlers, which breaks the Go runtime's (a nil
// dereference would kill the process instead of panicking). Load sets it
// to "" before opening the library unless the user has set it.
const EnvErrorSignals = "UCX_ERROR_SIGNALS"

var lib = dl.Library{Pkg: "ucx", Name: "libucp", Default: DefaultLibrary, Env: EnvLibrary}

// SetLibrary sets the path of libucp to load. It must be called before the
// first UCX call; afterwards it returns an error.
func SetLibrary(path string) error { return lib.Set(path) }

// Library returns the path that is (or will be) loaded.
func Library() string { return lib.Path() }

// Load loads libucp and resolves its entry points. It runs once; later
// calls return the first result. Every function of this package calls it.
func Load() error { return lib.Load(load) }

// procs holds the addresses of the entry points, called with SyscallN.
var procs struct {
	getVersion, initVersion, cleanup, contextQuery                  uintptr
	workerCreate, workerDestroy, workerQuery, workerProgress        uintptr
	workerGetAddress, workerReleaseAddress                          uintptr
	workerGetEfd, workerArm, workerSignal                           uintptr
	memMap, memUnmap, rkeyPack, rkeyBufferRelease                   uintptr
	epCreate, epCloseNbx, epRkeyUnpack, rkeyDestroy                 uintptr
	getNbx, requestCheckStatus, requestFree, requestCancel, epFlush uintptr
	tagSendNbx, tagRecvNbx, tagRecvRequestTest                      uintptr
	contextPrintInfo                                                uintptr // optional
}

// minMajor and minMinor are the oldest UCX whose ucp_get_nbx,
// ucp_ep_close_nbx and parameter layouts this package relies on.
const (
	minMajor = 1
	minMinor = 10
)

// EnvLogFile is UCX's setting of where it logs. Load sets it to "stderr"
// (UCX's name for the stream) unless the user has set it: UCX's default,
// stdout, would mix its warnings into output that scripts read (--json).
const EnvLogFile = "UCX_LOG_FILE"

func load(path string) error {
	for k, v := range map[string]string{EnvErrorSignals: "", EnvLogFile: "stderr"} {
		if _, set := os.LookupEnv(k); !set {
			if err := os.Setenv(k, v); err != nil {
				return &LoadError{Path: path, Reason: "cannot set " + k + ": " + err.Error()}
			}
		}
	}
	if err := loadSiblings(path); err != nil {
		return &LoadError{Path: path, Reason: err.Error()}
	}
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return &LoadError{Path: path, Reason: dl.OpenReason(err)}
	}
	syms := []struct {
		name string
		addr *uintptr
	}{
		{"ucp_get_version", &procs.getVersion},
		{"ucp_init_version", &procs.initVersion},
		{"ucp_cleanup", &procs.cleanup},
		{"ucp_context_query", &procs.contextQuery},
		{"ucp_worker_create", &procs.workerCreate},
		{"ucp_worker_destroy", &procs.workerDestroy},
		{"ucp_worker_query", &procs.workerQuery},
		{"ucp_worker_progress", &procs.workerProgress},
		{"ucp_worker_get_address", &procs.workerGetAddress},
		{"ucp_worker_release_address", &procs.workerReleaseAddress},
		{"ucp_worker_get_efd", &procs.workerGetEfd},
		{"ucp_worker_arm", &procs.workerArm},
		{"ucp_worker_signal", &procs.workerSignal},
		{"ucp_mem_map", &procs.memMap},
		{"ucp_mem_unmap", &procs.memUnmap},
		{"ucp_rkey_pack", &procs.rkeyPack},
		{"ucp_rkey_buffer_release", &procs.rkeyBufferRelease},
		{"ucp_ep_create", &procs.epCreate},
		{"ucp_ep_close_nbx", &procs.epCloseNbx},
		{"ucp_ep_rkey_unpack", &procs.epRkeyUnpack},
		{"ucp_rkey_destroy", &procs.rkeyDestroy},
		{"ucp_get_nbx", &procs.getNbx},
		{"ucp_request_check_status", &procs.requestCheckStatus},
		{"ucp_request_free", &procs.requestFree},
		{"ucp_request_cancel", &procs.requestCancel},
		{"ucp_ep_flush_nbx", &procs.epFlush},
		{"ucp_tag_send_nbx", &procs.tagSendNbx},
		{"ucp_tag_recv_nbx", &procs.tagRecvNbx},
		{"ucp_tag_recv_request_test", &procs.tagRecvRequestTest},
	}
	for _, s := range syms {
		p, err := purego.Dlsym(h, s.name)
		if err != nil {
			return &LoadError{Path: path, Reason: "it lacks " + s.name + ": not UCX's libucp, or a UCX older than 1.10"}
		}
		*s.addr = p
	}
	if p, err := purego.Dlsym(h, "ucp_context_print_info"); err == nil {
		procs.contextPrintInfo = p
	}
	major, minor, _ := getVersion()
	if major != minMajor || minor < minMinor {
		return &LoadError{Path: path, Reason: "it is UCX " + versionString(major, minor) + "; this needs UCX 1.x, x >= 10"}
	}
	return nil
}

// siblings are the libraries libucp needs, in the order they need each
// other.
var siblings = []string{"libucm.so.0", "libucs.so.0", "libuct.so.0"}

// loadSiblings loads the UCX libraries that lie next to a libucp given by
// path before libucp itself. The dynamic loader satisfies libucp's needs by
// soname from what is already loaded, so a UCX outside the library path
// (another build, a wheel) runs with its own libucs and libuct, and with
// the transport modules beside them, rather than with the system's.
func loadSiblings(path string) error {
	dir := filepath.Dir(path)
	if !strings.Contains(path, "/") {
		return nil // a bare soname: the loader's search finds a consistent set
	}
	for _, name := range siblings {
		p := filepath.Join(dir, name)
		if _, err := os.Stat(p); err != nil {
			continue
		}
		// Lazily: libucm and libucs call each other, so the first one
		// loaded has symbols only the next one defines.
		if _, err := purego.Dlopen(p, purego.RTLD_LAZY|purego.RTLD_GLOBAL); err != nil {
			return fmt.Errorf("cannot load %s beside it: %v", p, err)
		}
	}
	return nil
}

// loaded makes sure the library is loaded; if it is not, it returns the
// load error attributed to fn.
func loaded(fn string) error {
	if err := Load(); err != nil {
		return &Error{Func: fn, Err: err}
	}
	return nil
}
