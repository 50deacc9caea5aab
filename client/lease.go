package client

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Lease is a read-only view of a sealed object. Its memory stays valid,
// even if the object is deleted, until Release.
//
// Host objects are read through Bytes (or ReadAt); GPU objects through
// ReadAt, or on the device at Ptr (kernels, device-to-device copies: the
// zero-copy path), and Bytes is nil for them. A GPU object shared by
// descriptor (--gpu-share fd, and registered VMM memory) is mapped
// read-only (CU_MEM_ACCESS_FLAGS_PROT_READ): a memset or copy into it
// fails, a kernel's store faults, and the bytes stay unchanged. Legacy IPC
// has no read-only open: such a lease's memory is writable on the device,
// and writing it is a bug that other readers would see.
type Lease struct {
	c    *Client
	id   uint64
	info ObjectInfo

	mu       sync.RWMutex
	v        view
	m        *mapping // host arena mapping; nil for GPU objects and after Release
	released bool
	bundle   leaseManifest
	src      *leaseSources // a version published without a copy (nocopy.go); nil otherwise
	// The lease's slot in the lease table (1-based; 0: released through
	// the socket), its generation, and the arena it lies in; key is the
	// name it was got by (a later Get of that name takes it back), which
	// may be qualified (UID:NAME) where Info().Name is not.
	slot  int
	gen   uint64
	arena uint64
	key   string
}

// Get leases the sealed object name. It does not wait: when no sealed
// object of that name is visible (none, or one still being written) it
// fails at once with ErrNotFound. GetWith with GetOptions.Wait waits for
// it to be sealed, as long as ctx allows; other calls on the client
// proceed meanwhile.
func (c *Client) Get(ctx context.Context, name string) (*Lease, error) {
	if err := checkName("get", name); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, ctxError("get", name, err)
	}
	if l := c.retake(name); l != nil {
		return l, nil
	}
	return c.get(ctx, name, &storev1.GetRequest{Name: name}, false)
}

// get leases name through the socket; its callers have checked name.
// Unless wait, it asks the daemon not to wait, and a name with no sealed
// object is ErrNotFound.
func (c *Client) get(ctx context.Context, name string, gr *storev1.GetRequest, wait bool) (*Lease, error) {
	timeout := int64(0) // the daemon answers TIMEOUT at once: not sealed
	if wait {
		timeout = -1 // without limit
		if dl, ok := ctx.Deadline(); ok {
			timeout = max(time.Until(dl).Milliseconds(), 0)
		}
	}
	gr.TimeoutMs = timeout
	req := &storev1.Request{Body: &storev1.Request_Get{Get: gr}}
	r, err := c.roundTrip(ctx, "get", name, req)
	if err != nil {
		var e *Error
		if !wait && errors.As(err, &e) && e.Err == ErrTimeout && e.cause == nil {
			// Unsealed objects are invisible to readers: nothing tells a
			// name being written from one nobody uses.
			return nil, &Error{Op: "get", Name: name, Err: ErrNotFound, Message: "no sealed object of that name is visible to you (GetOptions.Wait waits for one)"}
		}
		// Whether the daemon's timeout (derived from the deadline) or the
		// context fired first, the error matches both.
		if errors.As(err, &e) && e.Err == ErrTimeout && timeout >= 0 {
			e.cause = context.DeadlineExceeded
		}
		return nil, err
	}
	g := r.resp.GetGet()
	p := g.GetPlacement()
	if p.GetWritable() || !r.holds(p) {
		c.cleanup(r, name)
		return nil, &Error{Op: "get", Name: name, Err: ErrInternal, Message: "daemon sent no read-only placement"}
	}
	// The object's region is the mapping's (placeGPU), not decoded again
	// from the info.
	info := infoBody(g.GetInfo())
	if info.Name == "" {
		info = ObjectInfo{Name: name, Size: int64(p.GetSize()), Device: p.GetDevice(), Sealed: true}
	}
	l := &Lease{c: c, id: g.GetLeaseId(), info: info, m: r.m, v: view{device: p.GetDevice(), size: int64(p.GetSize()), open: true}}
	l.bundle.file = r.manifest
	if t := c.table; t != nil && g.GetLeaseSlot() != 0 && int(g.GetLeaseSlot()) <= t.words.Len() && r.manifest == nil && info.Version == 0 {
		l.slot, l.gen, l.arena, l.key = int(g.GetLeaseSlot()), g.GetLeaseGen(), p.GetArenaId(), name
	}
	if r.m != nil {
		l.v.data = r.m.slice(p)
		return l, nil
	}
	if info.SourcesSize > 0 {
		return c.sourcesLease(ctx, l, r, p)
	}
	files := r.files
	if n := int(p.GetFiles()); p.GetExternal() && n > len(files) {
		if files, err = c.moreFiles(ctx, name, l.id, files, n); err != nil {
			c.cleanup(reply{resp: r.resp, manifest: r.manifest}, name) // releases the lease
			return nil, err
		}
	}
	if p.GetKind() == storev1.Placement_HOST { // registered host memory
		if err := c.mapHostExternal(name, p, files, &l.v); err != nil {
			c.cleanup(reply{resp: r.resp, manifest: r.manifest}, name) // releases the lease
			return nil, err
		}
		return l, nil
	}
	if err := c.placeGPU("get", name, p, files, &l.v); err != nil {
		c.cleanup(reply{resp: r.resp, manifest: r.manifest}, name) // releases the lease
		return nil, err
	}
	reg := l.v.gpu.Region()
	l.info.Region = &reg
	if !c.trackGPU(l) {
		l.v.close()
		return nil, &Error{Op: "get", Name: name, Err: ErrClosed}
	}
	return l, nil
}

// Bytes returns the memory of a host object, read-only (writing to it
// faults). It must not be used after Release. It is nil for a GPU object:
// use ReadAt, or Ptr on the device.
func (l *Lease) Bytes() []byte {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.v.data
}

// Device returns where the object's memory is: "host" or a GPU UUID.
func (l *Lease) Device() string { return l.v.device }

// Size returns the object's size in bytes.
func (l *Lease) Size() int64 { return l.v.size }

// Ptr returns the device address of a GPU object's first byte in this
// process (valid until Release), or 0 for a host object.
func (l *Lease) Ptr() cudaipc.DevicePtr {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.v.ptr()
}

// Mapping returns the Mapping of a GPU object (until Release), or nil for
// a host object. Its Region says how the object was shared: a cuda-ipc
// region (legacy IPC) or a vmm-fd one (a daemon started with --gpu-share
// fd). It belongs to the Lease: do not close it.
func (l *Lease) Mapping() *cudaipc.Mapping {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.v.mapping()
}

// CUDADevice returns the GPU a GPU object is mapped for in this process,
// for device work at Ptr (until Release), or nil for a host object.
func (l *Lease) CUDADevice() *cudaipc.Device {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.v.cudaDevice()
}

// ReadAt copies the object's bytes at offset off into p (io.ReaderAt), for
// host and GPU objects alike. It fails after Release.
func (l *Lease) ReadAt(p []byte, off int64) (int, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.src != nil && !l.released {
		return 0, &Error{Op: "read", Name: l.info.Name, Err: ErrInvalid, Message: "a version published without a copy lies in several regions of its publisher's memory: read it through Sources"}
	}
	return l.v.readAt("read", l.info.Name, p, off)
}

// Info describes the leased object as it was when the lease was granted.
func (l *Lease) Info() ObjectInfo { return l.info }

// ID returns the daemon's identifier of the lease.
func (l *Lease) ID() uint64 { return l.id }

// Release ends the lease and unmaps its memory when nothing else uses the
// mapping (a GPU mapping is closed before the daemon is told, so that the
// daemon may free the arena once the lease ends). Bytes, Ptr and Mapping
// must not be used afterwards.
//
// When Release returns nil the lease is over for the daemon: every
// connection, this one and others, sees it gone (Stat's Leases, List) and
// the memory it held reusable (a deleted object's space is free for the
// next Create). A lease of a plain object is released through the lease
// table when the connection has one (one compare-and-swap in shared
// memory, which the daemon reads: no round trip); otherwise, or for a
// deleted object, through the socket. Release waits for the daemon at most Options.CallTimeout;
// past that it fails with ErrTimeout and the daemon ends the lease when it
// reads the request (or when the connection closes). Release is
// idempotent; when the connection is already gone the daemon has ended
// the lease itself and Release returns nil.
func (l *Lease) Release() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.released {
		return nil
	}
	l.released = true
	if l.releaseFast() {
		return nil
	}
	l.bundle.close()
	verr := l.v.close()
	if l.src != nil {
		if err := l.src.close(); verr == nil {
			verr = err
		}
	}
	l.c.untrackGPU(l)
	// Bounded by the call timeout (roundTrip).
	req := &storev1.Request{Body: &storev1.Request_Release{Release: &storev1.ReleaseRequest{LeaseId: l.id}}}
	_, err := l.c.roundTrip(context.Background(), "release", l.info.Name, req)
	if l.m != nil {
		l.c.unref(l.m)
		l.m = nil
	}
	if isGone(err) {
		err = nil
	}
	var e *Error
	if errors.As(err, &e) && e.Err == ErrTimeout {
		e.Message = "the daemon did not acknowledge the release in time; it ends the lease when it reads the request or the connection closes"
	}
	if err == nil && verr != nil {
		err = &Error{Op: "release", Name: l.info.Name, Err: ErrInternal, Message: "unmapping the GPU object: " + verr.Error()}
	}
	return err
}

func isGone(err error) bool { return errors.Is(err, ErrStoreGone) || errors.Is(err, ErrClosed) }

// infoFromProto converts p, its region included.
func infoFromProto(p *storev1.ObjectInfo) ObjectInfo {
	in := infoBody(p)
	in.Region = decodeRegion(p.GetRegion())
	return in
}

// infoBody converts p but for its region, which a get takes from the
// object's mapping instead.
func infoBody(p *storev1.ObjectInfo) ObjectInfo {
	if p == nil {
		return ObjectInfo{}
	}
	return ObjectInfo{
		Name:     p.GetName(),
		Size:     int64(p.GetSize()),
		Device:   p.GetDevice(),
		Sealed:   p.GetSealed(),
		Leases:   int(p.GetLeases()),
		Shared:   p.GetShared(),
		Cluster:  p.GetCluster(),
		OwnerUID: p.GetOwnerUid(),
		Created:  time.Unix(0, p.GetCreatedUnixNano()),

		Version:      p.GetVersion(),
		Shards:       int(p.GetShards()),
		Shard:        int(p.GetShard()),
		ManifestSize: int64(p.GetManifestSize()),
		Tensors:      int(p.GetTensors()),
		Tensor:       tensorFromProto(p.GetTensor()),

		External:      p.GetExternal(),
		Orphaned:      p.GetOrphaned(),
		ExporterBound: p.GetExporterBound(),
		SourcesSize:   int64(p.GetSourcesSize()),

		CreatorCanWrite: p.GetCreatorCanWrite(),
		Partial:         p.GetPartial(),
		Space:           p.GetSpace(),
	}
}

// decodeRegion decodes the wire's region bytes: nil for none, and for bytes
// that are no region (ValidateResponse does not decode regions; mapping the
// object reports them).
func decodeRegion(b []byte) *cudaipc.Region {
	if len(b) == 0 {
		return nil
	}
	r, err := cudaipc.DecodeRegion(b)
	if err != nil {
		return nil
	}
	return &r
}
