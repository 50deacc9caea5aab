package client

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Lease is a read-only view of a sealed object. Its memory stays valid,
// even if the object is deleted, until Release.
type Lease struct {
	c    *Client
	id   uint64
	info ObjectInfo
	data []byte

	mu       sync.Mutex
	m        *mapping
	released bool
}

// Get waits until the object name exists and is sealed, then leases it.
// It waits as long as ctx allows: when ctx has a deadline and it passes,
// the error wraps ErrTimeout (and context.DeadlineExceeded). Other calls
// on the client proceed while Get waits.
func (c *Client) Get(ctx context.Context, name string) (*Lease, error) {
	if err := checkName("get", name); err != nil {
		return nil, err
	}
	timeout := int64(-1) // without limit
	if dl, ok := ctx.Deadline(); ok {
		timeout = max(time.Until(dl).Milliseconds(), 0)
	}
	req := &storev1.Request{Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: name, TimeoutMs: timeout}}}
	r, err := c.roundTrip(ctx, "get", name, req)
	if err != nil {
		// Whether the daemon's timeout (derived from the deadline) or the
		// context fired first, the error matches both.
		var e *Error
		if errors.As(err, &e) && errors.Is(e.Err, context.DeadlineExceeded) {
			e.Err, e.Message = ErrTimeout, "context deadline exceeded"
		}
		if errors.As(err, &e) && e.Err == ErrTimeout && timeout >= 0 {
			e.cause = context.DeadlineExceeded
		}
		return nil, err
	}
	g := r.resp.GetGet()
	p := g.GetPlacement()
	if r.m == nil || p.GetWritable() {
		if r.m != nil {
			c.unref(r.m)
		}
		return nil, &Error{Op: "get", Name: name, Err: ErrInternal, Message: "daemon sent no read-only placement"}
	}
	info := infoFromProto(g.GetInfo())
	if info.Name == "" {
		info = ObjectInfo{Name: name, Size: int64(p.GetSize()), Device: p.GetDevice(), Sealed: true, Region: regionJSON(p.GetRegion())}
	}
	return &Lease{c: c, id: g.GetLeaseId(), info: info, data: r.m.slice(p), m: r.m}, nil
}

// Bytes returns the object's memory, read-only (writing to it faults). It
// must not be used after Release.
func (l *Lease) Bytes() []byte { return l.data }

// Info describes the leased object as it was when the lease was granted.
func (l *Lease) Info() ObjectInfo { return l.info }

// ID returns the daemon's identifier of the lease.
func (l *Lease) ID() uint64 { return l.id }

// Release ends the lease and unmaps its memory when nothing else uses the
// mapping. Bytes must not be used afterwards. Release is idempotent; when
// the connection is already gone the daemon has ended the lease itself and
// Release returns nil.
func (l *Lease) Release() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.released {
		return nil
	}
	l.released = true
	req := &storev1.Request{Body: &storev1.Request_Release{Release: &storev1.ReleaseRequest{LeaseId: l.id}}}
	_, err := l.c.roundTrip(context.Background(), "release", l.info.Name, req)
	l.c.unref(l.m)
	l.m = nil
	l.data = nil
	if isGone(err) {
		return nil
	}
	return err
}

func isGone(err error) bool { return errors.Is(err, ErrStoreGone) || errors.Is(err, ErrClosed) }

func infoFromProto(p *storev1.ObjectInfo) ObjectInfo {
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
		OwnerUID: p.GetOwnerUid(),
		Created:  time.Unix(0, p.GetCreatedUnixNano()),
		Region:   regionJSON(p.GetRegion()),
	}
}

// regionJSON makes the wire's region bytes printable as JSON: as they are
// when they already are JSON, else as a base64 string.
func regionJSON(b []byte) json.RawMessage {
	if len(b) == 0 {
		return nil
	}
	if json.Valid(b) {
		return json.RawMessage(b)
	}
	s, _ := json.Marshal(b)
	return s
}
