package ucx

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"

	raw "github.com/cudaipc/cudaipc/internal/ucx"
)

// ErrNotFound matches every error caused by a missing or unusable libucp:
// the machine runs single-node.
var ErrNotFound = raw.ErrNotFound

// ErrClosed is returned by calls on a closed Context, Worker, MemRegion,
// Endpoint or RemoteKey, and by calls on objects whose parent was closed.
var ErrClosed = errors.New("ucx: use of a closed object")

// Status is a ucs_status_t; an *Error from UCX wraps one, so errors.Is
// matches the values below.
type Status = raw.Status

// Statuses a caller may act on. A pull that fails with one of them (see
// IsPeerFailure) should move to another holder.
const (
	StatusCanceled        = raw.ErrCanceled
	StatusUnreachable     = raw.ErrUnreachable
	StatusConnectionReset = raw.ErrConnectionReset
	StatusEndpointTimeout = raw.ErrEndpointTimeout
	StatusTimedOut        = raw.ErrTimedOut
	StatusNotConnected    = raw.ErrNotConnected
	StatusIOError         = raw.ErrIOError
)

// IsPeerFailure reports whether err says the peer (or the link to it) is
// gone rather than that the request was wrong: connection reset,
// unreachable, timeouts, UCX's link- and endpoint-failure ranges, and I/O
// errors. The endpoint is unusable afterwards; close it and use another
// holder.
func IsPeerFailure(err error) bool {
	var s raw.Status
	if !errors.As(err, &s) {
		return false
	}
	switch s {
	case raw.ErrConnectionReset, raw.ErrUnreachable, raw.ErrEndpointTimeout,
		raw.ErrTimedOut, raw.ErrNotConnected, raw.ErrIOError:
		return true
	}
	return s.IsLinkFailure() || s.IsEndpointFailure()
}

// DefaultLibrary is the libucp loaded unless EnvLibrary or SetLibrary
// names another; EnvLibrary is the environment variable that does.
const (
	DefaultLibrary = raw.DefaultLibrary
	EnvLibrary     = raw.EnvLibrary
)

// SetLibrary sets the path of libucp to load instead of libucp.so.0 (or
// $CUDAIPC_LIBUCP). It must be called before the first use of UCX.
func SetLibrary(path string) error { return raw.SetLibrary(path) }

// Library returns the path of libucp that is (or will be) loaded.
func Library() string { return raw.Library() }

// Available loads libucp if needed and returns nil when UCX can be used, or
// an error matching ErrNotFound that says what to install.
func Available() error { return raw.Load() }

// Version returns the version of the loaded UCX, e.g. "1.13.1".
func Version() (string, error) {
	major, minor, release, err := raw.GetVersion()
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%d.%d.%d", major, minor, release), nil
}

// MemoryType is a kind of memory UCX can register and move
// (ucs_memory_type_t).
type MemoryType = raw.MemoryType

// Memory types a Context may report.
const (
	MemoryHost        = raw.MemoryTypeHost
	MemoryCUDA        = raw.MemoryTypeCUDA
	MemoryCUDAManaged = raw.MemoryTypeCUDAManaged
	MemoryROCm        = raw.MemoryTypeROCm
	MemoryROCmManaged = raw.MemoryTypeROCmManaged
	MemoryRDMA        = raw.MemoryTypeRDMA
)

// ContextOptions are the settings of NewContext. The zero value is right
// for a daemon. Transports and devices come from UCX's environment
// (UCX_TLS, UCX_NET_DEVICES, ...), read when the Context is made.
type ContextOptions struct {
	// Name names the context in UCX's logs; empty leaves UCX's default.
	Name string
	// NoRMA leaves out UCX's RMA feature: the context's workers neither
	// read with Get nor answer peers' GETs; Fetch works both ways. Over
	// tcp UCX answers an emulated GET of any address of the process,
	// whatever rkey came with it: a context that serves peers it does not
	// trust should set NoRMA and be read with Fetch, which answers only
	// for bytes inside a Window.
	NoRMA bool
}

// Context is a UCP context (ucp_context_h) with the features this module
// uses: RMA (one-sided GET) and wakeup (so that a Worker can sleep in Serve
// instead of spinning). Close releases it and everything still open on it.
type Context struct {
	mu       sync.Mutex
	h        raw.Context
	closed   bool
	memTypes uint64
	workers  map[*Worker]struct{}
	// serving is a copy of workers' keys, replaced (under mu) as workers
	// come and go: what Window.Ready wakes, read without mu.
	serving atomic.Pointer[[]*Worker]
	regions map[*MemRegion]struct{}
	windows map[Token]*Window
	noRMA   bool
	fetched fetchCounters
	handles *handles // what a cleanup releases if the Context is dropped unclosed
}

// handles are the raw UCX objects of a Context, kept apart from it (and
// from everything that points back at it) so that a runtime cleanup can
// release them when the Context and all its objects have become
// unreachable without Close: the backstop against a leaked Context.
type handles struct {
	mu      sync.Mutex
	h       raw.Context
	closed  bool
	workers map[raw.Worker]struct{}
	mems    map[raw.Mem]struct{}
}

func (hs *handles) add(w raw.Worker, m raw.Mem) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if w != 0 {
		hs.workers[w] = struct{}{}
	}
	if m != 0 {
		hs.mems[m] = struct{}{}
	}
}

func (hs *handles) remove(w raw.Worker, m raw.Mem) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	delete(hs.workers, w)
	delete(hs.mems, m)
}

// leakedContexts counts Contexts released by the cleanup, for tests.
var leakedContexts atomic.Int64

func releaseLeaked(hs *handles) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if hs.closed {
		return
	}
	hs.closed = true
	slog.Warn("ucx: a Context became unreachable without Close; releasing its UCX resources", "workers", len(hs.workers), "regions", len(hs.mems))
	for w := range hs.workers {
		raw.WorkerDestroy(w)
	}
	for m := range hs.mems {
		_ = raw.MemUnmap(hs.h, m)
	}
	raw.Cleanup(hs.h)
	leakedContexts.Add(1)
}

// NewContext initializes UCX (ucp_init_version). Without libucp it returns
// an error matching ErrNotFound.
func NewContext(o ContextOptions) (*Context, error) {
	p := &raw.Params{
		FieldMask:       raw.ParamFieldFeatures | raw.ParamFieldMtWorkersShared,
		Features:        raw.FeatureTag | raw.FeatureWakeup,
		MtWorkersShared: 1, // workers are driven from different OS threads
	}
	if !o.NoRMA {
		p.Features |= raw.FeatureRMA
	}
	if o.Name != "" {
		p.FieldMask |= raw.ParamFieldName
		p.Name = cString(o.Name)
	}
	h, err := raw.InitVersion(p)
	if err != nil {
		return nil, err
	}
	attr := &raw.ContextAttr{FieldMask: raw.AttrFieldMemoryTypes}
	if err := raw.ContextQuery(h, attr); err != nil {
		raw.Cleanup(h)
		return nil, err
	}
	c := &Context{
		h:        h,
		memTypes: attr.MemoryTypes,
		workers:  map[*Worker]struct{}{},
		regions:  map[*MemRegion]struct{}{},
		windows:  map[Token]*Window{},
		noRMA:    o.NoRMA,
		handles:  &handles{h: h, workers: map[raw.Worker]struct{}{}, mems: map[raw.Mem]struct{}{}},
	}
	runtime.AddCleanup(c, releaseLeaked, c.handles)
	return c, nil
}

// MemoryTypes returns the kinds of memory this UCX can register, as
// ucp_context_query reports them: host always; MemoryCUDA only where UCX
// was built with CUDA support and finds a driver.
func (c *Context) MemoryTypes() []MemoryType {
	var out []MemoryType
	for i := 0; i < 64; i++ {
		if c.memTypes&(1<<i) != 0 {
			out = append(out, MemoryType(i))
		}
	}
	return out
}

// Supports reports whether UCX can register memory of type t.
func (c *Context) Supports(t MemoryType) bool {
	return t >= 0 && t < 64 && c.memTypes&(1<<uint(t)) != 0
}

// Close closes the context's workers and memory regions that are still
// open, then releases the context (ucp_cleanup). It is idempotent.
func (c *Context) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	workers := make([]*Worker, 0, len(c.workers))
	for w := range c.workers {
		workers = append(workers, w)
	}
	regions := make([]*MemRegion, 0, len(c.regions))
	for r := range c.regions {
		regions = append(regions, r)
	}
	c.mu.Unlock()
	var errs []error
	for _, w := range workers {
		errs = append(errs, w.Close())
	}
	for _, r := range regions {
		errs = append(errs, r.Close())
	}
	c.handles.mu.Lock()
	c.handles.closed = true
	c.handles.mu.Unlock()
	raw.Cleanup(c.h)
	return errors.Join(errs...)
}

func cString(s string) *byte {
	b := make([]byte, len(s)+1)
	copy(b, s)
	return &b[0]
}

// Resource is a transport on a device that the context can use, as UCX
// names them: Transport "tcp", Device "lo"; Transport "rc_mlx5", Device
// "mlx5_0:1"; Transport "cuda_copy", Device "cuda".
type Resource struct {
	Transport, Device string
}

func (r Resource) String() string { return r.Transport + "/" + r.Device }

// Info returns UCX's description of the context (ucp_context_print_info):
// its components, memory domains and transport resources.
func (c *Context) Info() (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return "", ErrClosed
	}
	return raw.ContextPrintInfo(c.h)
}

// Resources returns the transports and devices the context found (after
// UCX_TLS and UCX_NET_DEVICES), read from Info.
func (c *Context) Resources() ([]Resource, error) {
	info, err := c.Info()
	if err != nil {
		return nil, err
	}
	return parseResources(info), nil
}

// parseResources reads the "resource N : md M dev D flags XX tl/dev" lines
// of ucp_context_print_info (UCX 1.13 to 1.16).
func parseResources(info string) []Resource {
	var out []Resource
	for _, line := range strings.Split(info, "\n") {
		f := strings.Fields(strings.TrimPrefix(strings.TrimSpace(line), "#"))
		if len(f) < 2 || f[0] != "resource" {
			continue
		}
		tl, dev, ok := strings.Cut(f[len(f)-1], "/")
		if !ok {
			continue
		}
		out = append(out, Resource{Transport: tl, Device: dev})
	}
	return out
}

// workersChangedLocked refreshes c.serving after c.workers changed; c.mu
// is held.
func (c *Context) workersChangedLocked() {
	ws := make([]*Worker, 0, len(c.workers))
	for w := range c.workers {
		ws = append(ws, w)
	}
	c.serving.Store(&ws)
}
