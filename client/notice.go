package client

import (
	"context"
	"fmt"
	"sync"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Notices: a reader of registered memory tells the process that registered
// it something through the daemon (Notify); that process takes what it was
// told with TakeNotices or WaitNotices. Package kv uses them so that an
// engine learns that a reader is done with its blocks (docs/kv.md).

// MaxKeptNotices bounds the notices a client keeps until they are taken;
// beyond it the oldest are dropped and counted (NoticesDropped).
const MaxKeptNotices = 1 << 16

// Notice is what a reader sent about registered memory of this client.
type Notice struct {
	// Name is the registered memory's qualified name (UID:NAME).
	Name    string
	Payload []byte
	// UID and PID are the sender's, as the daemon saw them.
	UID, PID uint32
}

// notices is a client's queue of notices not taken yet.
type notices struct {
	mu      sync.Mutex
	list    []Notice
	dropped int
	arrived chan struct{} // closed when a notice arrives, then replaced
}

func (q *notices) push(n *storev1.Notice) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.list) >= MaxKeptNotices {
		q.list = q.list[1:]
		q.dropped++
	}
	q.list = append(q.list, Notice{Name: n.GetName(), Payload: n.GetPayload(), UID: n.GetUid(), PID: n.GetPid()})
	if q.arrived != nil {
		close(q.arrived)
		q.arrived = nil
	}
}

// take removes and returns the notices about names (all, without names),
// in arrival order, and a channel closed when the next notice arrives.
func (q *notices) take(names []string) ([]Notice, <-chan struct{}) {
	q.mu.Lock()
	defer q.mu.Unlock()
	var out []Notice
	keep := q.list[:0]
	for _, n := range q.list {
		if wanted(n.Name, names) {
			out = append(out, n)
		} else {
			keep = append(keep, n)
		}
	}
	clear(q.list[len(keep):])
	q.list = keep
	if q.arrived == nil {
		q.arrived = make(chan struct{})
	}
	return out, q.arrived
}

func wanted(name string, names []string) bool {
	if len(names) == 0 {
		return true
	}
	for _, n := range names {
		if n == name {
			return true
		}
	}
	return false
}

// Notify sends payload (at most protocol.MaxNoticePayload bytes) to the
// process that registered the memory name, which this client must be
// able to get. It fails with ErrNotFound when there is no such registered
// memory or its exporter's connection ended, and ErrLimit when the
// exporter has too many notices not delivered yet.
func (c *Client) Notify(ctx context.Context, name string, payload []byte) error {
	if err := checkName("notify", name); err != nil {
		return err
	}
	if len(payload) > protocol.MaxNoticePayload {
		return &Error{Op: "notify", Name: name, Err: ErrInvalid, Message: fmt.Sprintf("a payload of %d bytes: at most %d", len(payload), protocol.MaxNoticePayload)}
	}
	req := &storev1.Request{Body: &storev1.Request_Notify{Notify: &storev1.NotifyRequest{Name: name, Payload: payload}}}
	_, err := c.roundTrip(ctx, "notify", name, req)
	return err
}

// NotifySpace sends payload (at most protocol.MaxNoticePayload bytes) to
// the engine of the KV space whose description is space (kv.Desc's binary
// encoding), registered on another node of the daemon's cluster: the
// daemons forward it (kv_notify), and it reaches the engine as a notice
// of this client's uid on the space's first region (pid 0). It fails with
// ErrNotFound when that node has no such space for this uid or its engine
// is gone, ErrUnavailable when the node cannot be reached, ErrInvalid for
// a daemon outside a cluster or a space of its own node (use Notify).
func (c *Client) NotifySpace(ctx context.Context, space, payload []byte) error {
	if len(payload) > protocol.MaxNoticePayload {
		return &Error{Op: "kv_notify", Err: ErrInvalid, Message: fmt.Sprintf("a payload of %d bytes: at most %d", len(payload), protocol.MaxNoticePayload)}
	}
	req := &storev1.Request{Body: &storev1.Request_KvNotify{KvNotify: &storev1.KvNotifyRequest{Space: space, Payload: payload}}}
	_, err := c.roundTrip(ctx, "kv_notify", "", req)
	return err
}

// TakeNotices removes and returns the notices readers sent about the
// registered memory names (qualified, as Notice.Name; every notice
// without names), oldest first. It never blocks.
func (c *Client) TakeNotices(names ...string) []Notice {
	out, _ := c.notices.take(names)
	return out
}

// WaitNotices is TakeNotices that waits, as long as ctx allows, until
// there is at least one.
func (c *Client) WaitNotices(ctx context.Context, names ...string) ([]Notice, error) {
	for {
		out, arrived := c.notices.take(names)
		if len(out) > 0 {
			return out, nil
		}
		select {
		case <-arrived:
		case <-c.readerDone:
			c.mu.Lock()
			err := c.err
			c.mu.Unlock()
			return nil, &Error{Op: "notices", Err: err}
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// NoticesDropped says how many notices were dropped, oldest first, because
// MaxKeptNotices were kept untaken.
func (c *Client) NoticesDropped() int {
	c.notices.mu.Lock()
	defer c.notices.mu.Unlock()
	return c.notices.dropped
}
