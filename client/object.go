package client

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// MaxObjectSize is the largest object the protocol allows (1 TiB).
const MaxObjectSize = 1 << 40

// Object is an object being written: Create returns it, Seal publishes it,
// Abort discards it.
//
// Host objects are written through Bytes (or WriteAt); GPU objects through
// WriteAt, or on the device at Ptr (kernels, copies; keep the Object
// reachable meanwhile), and Bytes is nil for them. Seal and Abort end
// writing: the Object's memory is unmapped before the daemon is told, so
// Bytes, Ptr and Mapping must not be used afterwards (a GPU mapping must be
// closed before the daemon may free its arena). Device work on Ptr must be
// complete (synchronized) before Seal.
type Object struct {
	c    *Client
	name string
	p    *storev1.Placement

	mu   sync.RWMutex
	v    view
	m    *mapping // host arena mapping; nil after Seal or Abort, and for GPU objects
	done bool

	version uint64 // for a shard of a version
	shard   int
	shared  bool // a shared object: its host arena is its own
}

// Create allocates a writable object of size bytes named name. Only this
// client can see it until Seal. If the client closes (or its process dies)
// before Seal, the daemon discards the object.
func (c *Client) Create(ctx context.Context, name string, size int64, opts CreateOptions) (*Object, error) {
	if err := checkName("create", name); err != nil {
		return nil, err
	}
	dev, err := resolveDevice(opts.Device)
	if err == nil {
		err = protocol.ValidateDevice(dev)
	}
	if err != nil {
		return nil, &Error{Op: "create", Name: name, Err: ErrInvalid, Message: err.Error()}
	}
	if size <= 0 || size > MaxObjectSize {
		return nil, &Error{Op: "create", Name: name, Err: ErrInvalid, Message: fmt.Sprintf("size %d is outside 1..%d", size, int64(MaxObjectSize))}
	}
	tensor := opts.Tensor.proto()
	if err := protocol.ValidateTensor(tensor, uint64(size)); err != nil {
		return nil, &Error{Op: "create", Name: name, Err: ErrInvalid, Message: err.(*protocol.CodeError).Message}
	}
	cr := &storev1.CreateRequest{Name: name, Size: uint64(size), Device: dev, Shared: opts.Shared, Tensor: tensor, Cluster: opts.Cluster, NoEvict: opts.NoEvict}
	if err := opts.extend(cr); err != nil {
		return nil, &Error{Op: "create", Name: name, Err: ErrInvalid, Message: err.Error()}
	}
	req := &storev1.Request{Body: &storev1.Request_Create{Create: cr}}
	r, err := c.roundTrip(ctx, "create", name, req)
	if err != nil {
		return nil, err
	}
	p := r.resp.GetCreate().GetPlacement()
	if !p.GetWritable() || p.GetSize() != uint64(size) || !r.holds(p) || (len(opts.Manifest) > 0) != (r.manifest != nil) {
		c.cleanup(r, name)
		return nil, &Error{Op: "create", Name: name, Err: ErrInternal, Message: "daemon sent no writable placement of the requested size"}
	}
	if r.manifest != nil {
		_, err := r.manifest.WriteAt(opts.Manifest, 0)
		r.manifest.Close()
		r.manifest = nil
		if err != nil {
			c.cleanup(r, name)
			return nil, &Error{Op: "create", Name: name, Err: ErrInternal, Message: "writing the manifest: " + err.Error()}
		}
	}
	o := &Object{c: c, name: name, p: p, m: r.m, v: view{device: p.GetDevice(), size: size, open: true},
		version: r.resp.GetCreate().GetVersion(), shard: opts.Shard, shared: opts.Shared}
	if r.m != nil {
		o.v.data = r.m.slice(p)
		return o, nil
	}
	if err = c.placeGPU("create", name, p, r.files, &o.v); err != nil {
		c.cleanup(reply{resp: r.resp}, name) // aborts the object
		return nil, err
	}
	if !c.trackGPU(o) {
		o.v.close()
		return nil, &Error{Op: "create", Name: name, Err: ErrClosed}
	}
	return o, nil
}

// Name returns the object's name.
func (o *Object) Name() string { return o.name }

// Size returns the object's size in bytes.
func (o *Object) Size() int64 { return o.v.size }

// Device returns where the object's memory is: "host" or a GPU UUID.
func (o *Object) Device() string { return o.v.device }

// Bytes returns the memory of a host object, writable until Seal or Abort.
// It must not be used after either. It is nil for a GPU object: use
// WriteAt, or Ptr on the device.
func (o *Object) Bytes() []byte {
	o.mu.RLock()
	defer o.mu.RUnlock()
	return o.v.data
}

// Ptr returns the device address of a GPU object's first byte in this
// process (valid until Seal or Abort), or 0 for a host object.
func (o *Object) Ptr() cudaipc.DevicePtr {
	o.mu.RLock()
	defer o.mu.RUnlock()
	return o.v.ptr()
}

// Mapping returns the Mapping of a GPU object (until Seal or Abort), or
// nil for a host object. Its Region says how the object was shared: a
// cuda-ipc region (legacy IPC) or a vmm-fd one (a daemon started with
// --gpu-share fd). It belongs to the Object: do not close it.
func (o *Object) Mapping() *cudaipc.Mapping {
	o.mu.RLock()
	defer o.mu.RUnlock()
	return o.v.mapping()
}

// CUDADevice returns the GPU a GPU object is mapped for in this process,
// for device work at Ptr (until Seal or Abort), or nil for a host object.
func (o *Object) CUDADevice() *cudaipc.Device {
	o.mu.RLock()
	defer o.mu.RUnlock()
	return o.v.cudaDevice()
}

// WriteAt copies p into the object at offset off, for host and GPU objects
// alike. Writes past the end of the object fail; so do writes after Seal or
// Abort.
func (o *Object) WriteAt(p []byte, off int64) (int, error) {
	o.mu.RLock()
	defer o.mu.RUnlock()
	return o.v.writeAt("write", o.name, p, off)
}

// ReadAt copies the object's bytes at offset off into p (io.ReaderAt), for
// host and GPU objects alike, until Seal or Abort.
func (o *Object) ReadAt(p []byte, off int64) (int, error) {
	o.mu.RLock()
	defer o.mu.RUnlock()
	return o.v.readAt("read", o.name, p, off)
}

// Seal makes the object immutable and visible to readers. Its memory is
// unmapped in this process first: Bytes, Ptr and Mapping must not be used
// afterwards. If ctx ends before the daemon answers, the object is still
// unsealed and can be sealed (or aborted) again, but no longer written.
func (o *Object) Seal(ctx context.Context) error {
	return o.finish(ctx, "seal", &storev1.Request{Body: &storev1.Request_Seal{Seal: &storev1.SealRequest{Name: o.name, Version: o.version, Shard: uint32(o.shard)}}})
}

// SealAfter seals the object once ev has completed. ev is an interprocess
// event of this process (Device.NewIPCEvent), recorded with Signal after the
// device work that writes the object (a copy into Ptr on a stream, say). The
// seal is sent at once, so its round trip overlaps that work: the daemon
// polls the event (it never waits in the driver) and seals the moment it
// completes, and SealAfter returns then. Until it returns, the queued work
// may keep writing through Ptr; afterwards Bytes, Ptr and Mapping must not
// be used. One seal per connection may wait on an event at a time, and a
// connection may have the daemon open at most 8 events: keep one per GPU.
//
// A daemon that cannot use the event (one in another PID namespace, say)
// answers ErrInvalid with a message starting "wait_event": the object is
// then still unsealed and writable; synchronize ev and Seal. If ctx ends
// first, SealAfter waits for ev itself (the work may still write the
// object), returns ctx's error, and the daemon seals when it sees the event.
func (o *Object) SealAfter(ctx context.Context, ev *cudaipc.Event) error {
	if ev == nil {
		return &Error{Op: "seal", Name: o.name, Err: ErrInvalid, Message: "no event: use Seal"}
	}
	d, err := ev.Export()
	var blob []byte
	if err == nil {
		blob, err = d.MarshalBinary()
	}
	if err != nil {
		return &Error{Op: "seal", Name: o.name, Err: ErrInvalid, Message: "the event cannot be shared: " + err.Error() + " (create it with Device.NewIPCEvent)"}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.done {
		return &Error{Op: "seal", Name: o.name, Err: ErrInvalid, Message: "object already sealed or aborted"}
	}
	req := &storev1.Request{Body: &storev1.Request_Seal{Seal: &storev1.SealRequest{Name: o.name, Version: o.version,
		Shard: uint32(o.shard), WaitEvent: blob}}}
	_, err = o.c.roundTrip(ctx, "seal", o.name, req)
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		// The seal is still on its way; the work may still write the object.
		if serr := ev.Synchronize(); serr != nil {
			return errors.Join(err, serr)
		}
	} else if err != nil {
		return err // the daemon refused the seal: the object is unsealed and still ours
	}
	verr := o.v.close()
	o.c.untrackGPU(o)
	return o.settle("seal", err, verr)
}

// Abort discards the object. Bytes, Ptr and Mapping must not be used
// afterwards.
func (o *Object) Abort(ctx context.Context) error {
	return o.finish(ctx, "abort", &storev1.Request{Body: &storev1.Request_Abort{Abort: &storev1.AbortRequest{Name: o.name, Version: o.version, Shard: uint32(o.shard)}}})
}

func (o *Object) finish(ctx context.Context, op string, req *storev1.Request) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.done {
		return &Error{Op: op, Name: o.name, Err: ErrInvalid, Message: "object already sealed or aborted"}
	}
	// Once sealed, the object may be deleted and its arena freed at once:
	// a GPU mapping must be gone before the daemon hears of the seal.
	verr := o.v.close()
	o.c.untrackGPU(o)
	_, err := o.c.roundTrip(ctx, op, o.name, req)
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err // the object may still be ours: Seal or Abort again
	}
	return o.settle(op, err, verr)
}

// settle marks the object finished once its seal or abort has been
// answered (err: the daemon's answer; verr: unmapping its GPU memory, which
// the caller did), lets go of a host arena mapping, and returns err or,
// when the daemon agreed, verr. o.mu is held.
func (o *Object) settle(op string, err, verr error) error {
	o.done = true
	if o.m != nil {
		if op == "seal" && err == nil && o.shared {
			o.c.unrefSealed(o.m)
		} else {
			o.c.unref(o.m)
		}
		o.m = nil
	}
	if err == nil && verr != nil {
		err = &Error{Op: op, Name: o.name, Err: ErrInternal, Message: "unmapping the GPU object: " + verr.Error()}
	}
	return err
}

// checkName applies the protocol's name rules before asking the daemon.
func checkName(op, name string) error {
	if err := protocol.ValidateName(name); err != nil {
		var ce *protocol.CodeError
		msg := err.Error()
		if errors.As(err, &ce) {
			msg = ce.Message
		}
		return &Error{Op: op, Name: name, Err: ErrInvalid, Message: msg + " (names are 1 to 255 bytes of printable UTF-8)"}
	}
	return nil
}
