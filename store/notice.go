package store

import (
	"fmt"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Notices: a reader of registered memory tells its exporter something (a
// KV reader: "my read of your blocks ended", docs/kv.md) through the
// daemon, which knows the exporter's connection. The daemon queues a
// notice on that connection, bounded by protocol.MaxPendingNotices, and its
// sender goroutine (tellFreed) writes it with id 0, unasked.

// sendNotice queues payload for the exporter of the registered memory
// name, from ss. The sender must be able to read name.
func (ss *session) sendNotice(name string, payload []byte) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return errSessionClosed
	}
	return s.noticeLocked(ss.peer, name, payload)
}

// Notify queues payload for the exporter of the registered memory name
// (qualified), from a reader of uid reader on another node (a KV read
// across nodes that ended: docs/kv.md), as a notify request of that uid
// would; the notice's pid is 0. It fails as notify does: ErrNotFound,
// ErrLimit.
func (rp *Replicas) Notify(reader uint32, name string, payload []byte) error {
	s := rp.s
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.noticeLocked(peer{uid: reader}, name, payload)
}

// noticeLocked queues payload from the peer from for the exporter of the
// registered memory name, which from must be able to read.
func (s *Store) noticeLocked(from peer, name string, payload []byte) error {
	e := s.lookupLocked(name)
	if e.kind != kindExternal || !e.ext.readableBy(from.uid) {
		return fmt.Errorf("no registered memory %q to notify: %w", name, ErrNotFound)
	}
	to := e.ext.registrar
	if to == nil || to.closed {
		return fmt.Errorf("registered memory %q: its exporter's connection ended: %w", name, ErrNotFound)
	}
	if len(to.notices) >= protocol.MaxPendingNotices {
		return fmt.Errorf("the exporter of %q has %d notices not sent yet: %w", name, len(to.notices), ErrLimit)
	}
	to.notices = append(to.notices, &storev1.Notice{Name: name, Payload: payload, Uid: from.uid, Pid: uint32(from.pid)})
	select {
	case to.notify <- struct{}{}:
	default:
	}
	return nil
}

// takeNoticesLocked returns the notices queued for this session.
func (ss *session) takeNoticesLocked() []*storev1.Notice {
	n := ss.notices
	ss.notices = nil
	return n
}
