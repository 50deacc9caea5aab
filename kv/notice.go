package kv

import (
	"context"

	"github.com/cudaipc/cudaipc/client"
)

// Notices: a read with Request.Notify set tells the source's engine, when
// it ends, that this reader is done with the blocks (vLLM's get_finished:
// the prefill engine may free them), through the daemon. The engine takes
// them from its Space. A notice's payload on the wire is one status byte
// (0: the read completed; 1: it failed) followed by Request.Notify.

// Notice is a reader's word that its read of this space ended.
type Notice struct {
	// Payload is the reader's Request.Notify (a request id, say).
	Payload []byte
	// Failed is set when the read did not complete (its blocks are not
	// all at the reader: it may read them again).
	Failed bool
	// UID and PID are the reader's, as the daemon saw them.
	UID, PID uint32
}

// TakeNotices removes and returns the notices readers sent this space,
// oldest first, without blocking.
func (s *Space) TakeNotices() []Notice {
	return decodeNotices(s.c.TakeNotices(s.noticeName()))
}

// WaitNotices is TakeNotices that waits, as long as ctx allows, until
// there is at least one.
func (s *Space) WaitNotices(ctx context.Context) ([]Notice, error) {
	for {
		raw, err := s.c.WaitNotices(ctx, s.noticeName())
		if err != nil {
			return nil, err
		}
		if out := decodeNotices(raw); len(out) > 0 {
			return out, nil
		}
	}
}

// noticeName is the region readers notify: the space's first.
func (s *Space) noticeName() string { return s.desc.RegionName(0) }

// decodeNotices keeps the notices of the kv form; a payload without its
// status byte (any reader may notify) is dropped.
func decodeNotices(raw []client.Notice) []Notice {
	var out []Notice
	for _, n := range raw {
		if len(n.Payload) == 0 || n.Payload[0] > 1 {
			continue
		}
		out = append(out, Notice{Payload: n.Payload[1:], Failed: n.Payload[0] == 1, UID: n.UID, PID: n.PID})
	}
	return out
}
