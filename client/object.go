package client

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// MaxObjectSize is the largest object the protocol allows (1 TiB).
const MaxObjectSize = 1 << 40

// Object is an object being written: Create returns it, Seal publishes it,
// Abort discards it.
type Object struct {
	c    *Client
	name string
	data []byte
	p    *storev1.Placement

	mu   sync.Mutex
	m    *mapping // nil after Seal or Abort
	done bool
}

// Create allocates a writable object of size bytes named name. Only this
// client can see it until Seal. If the client closes (or its process dies)
// before Seal, the daemon discards the object.
func (c *Client) Create(ctx context.Context, name string, size int64, opts CreateOptions) (*Object, error) {
	if err := checkName("create", name); err != nil {
		return nil, err
	}
	if err := protocol.ValidateDevice(opts.Device); err != nil {
		return nil, &Error{Op: "create", Name: name, Err: ErrInvalid, Message: err.Error()}
	}
	if size <= 0 || size > MaxObjectSize {
		return nil, &Error{Op: "create", Name: name, Err: ErrInvalid, Message: fmt.Sprintf("size %d is outside 1..%d", size, int64(MaxObjectSize))}
	}
	req := &storev1.Request{Body: &storev1.Request_Create{Create: &storev1.CreateRequest{
		Name: name, Size: uint64(size), Device: opts.Device, Shared: opts.Shared}}}
	r, err := c.roundTrip(ctx, "create", name, req)
	if err != nil {
		return nil, err
	}
	p := r.resp.GetCreate().GetPlacement()
	if r.m == nil || !p.GetWritable() || p.GetSize() != uint64(size) {
		if r.m != nil {
			c.unref(r.m)
		}
		return nil, &Error{Op: "create", Name: name, Err: ErrInternal, Message: "daemon sent no writable placement of the requested size"}
	}
	return &Object{c: c, name: name, data: r.m.slice(p), p: p, m: r.m}, nil
}

// Name returns the object's name.
func (o *Object) Name() string { return o.name }

// Bytes returns the object's memory, writable until Seal or Abort. It must
// not be used after either.
func (o *Object) Bytes() []byte { return o.data }

// Seal makes the object immutable and visible to readers. Bytes must not be
// used afterwards.
func (o *Object) Seal(ctx context.Context) error {
	return o.finish(ctx, "seal", &storev1.Request{Body: &storev1.Request_Seal{Seal: &storev1.SealRequest{Name: o.name}}})
}

// Abort discards the object. Bytes must not be used afterwards.
func (o *Object) Abort(ctx context.Context) error {
	return o.finish(ctx, "abort", &storev1.Request{Body: &storev1.Request_Abort{Abort: &storev1.AbortRequest{Name: o.name}}})
}

func (o *Object) finish(ctx context.Context, op string, req *storev1.Request) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.done {
		return &Error{Op: op, Name: o.name, Err: ErrInvalid, Message: "object already sealed or aborted"}
	}
	_, err := o.c.roundTrip(ctx, op, o.name, req)
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err // the object may still be ours: Seal or Abort again
	}
	o.done = true
	o.c.unref(o.m)
	o.m = nil
	o.data = nil
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
		return &Error{Op: op, Name: name, Err: ErrInvalid, Message: msg + " (names are 1 to 255 bytes of printable UTF-8 without '/')"}
	}
	return nil
}
