package cluster

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// MaxInline is the largest object a pull reads in the control channel's
// answer instead of with UCX. A small object's get then costs one round
// trip to the holder (the "read" below) instead of two (the "open" that
// says where the replica lies, then the GET), and leaves no exposure to
// release and no pin to write.
const MaxInline = 64 << 10

// ReplicaReader is a Source that also copies small replicas out whole,
// for the control channel's "read". A Source without it answers "read"
// as an unknown op, and readers fall back to "open".
type ReplicaReader interface {
	// ReadReplica returns a copy of the local replica of ref, incarnation
	// id, made while the replica is held (no eviction, no reuse of its
	// memory during the copy). It fails with an error wrapping
	// ErrNotFound when this node holds no such replica, and refuses a
	// replica larger than max.
	ReadReplica(ref Ref, id string, max int64) ([]byte, error)
}

// errNoInline: the peer does not serve "read" (an older daemon, or a
// Source that cannot copy): the pull opens the replica instead.
var errNoInline = errors.New("the node does not serve inline reads")

const unknownOp = "unknown control op"

// serveRead answers "read": the replica's bytes follow the answer in a
// frame of their own, sealed like every frame of the channel.
func (s *ControlServer) serveRead(req ctlRequest) (ctlResponse, []byte) {
	var resp ctlResponse
	rr, ok := s.Source.(ReplicaReader)
	if !ok {
		resp.Err = fmt.Sprintf("%s %q", unknownOp, req.Op)
		return resp, nil
	}
	b, err := rr.ReadReplica(req.Ref, req.ID, MaxInline)
	if err != nil {
		resp.Err, resp.NotHeld = err.Error(), errors.Is(err, ErrNotFound)
		return resp, nil
	}
	if len(b) == 0 || len(b) > MaxInline {
		resp.Err = fmt.Sprintf("replica of %d bytes cannot be read inline", len(b))
		return resp, nil
	}
	resp.Inline = int64(len(b))
	return resp, b
}

// Read asks the node for a copy of its replica of ref, incarnation id,
// which must be size bytes (at most MaxInline). It fails wrapping
// ErrNotFound when the node does not hold that incarnation.
func (cc *ControlClient) Read(ctx context.Context, ref Ref, id string, size int64) ([]byte, error) {
	var data []byte
	resp, err := cc.exchange(ctx, ctlRequest{Op: "read", Ref: ref, ID: id}, &data)
	if err != nil {
		return nil, err
	}
	if resp.Err != "" {
		switch {
		case resp.NotHeld:
			return nil, fmt.Errorf("node %s: %w: %s", cc.ch.peer, ErrNotFound, resp.Err)
		case strings.HasPrefix(resp.Err, unknownOp):
			return nil, fmt.Errorf("node %s: %w", cc.ch.peer, errNoInline)
		}
		return nil, fmt.Errorf("node %s: %s", cc.ch.peer, resp.Err)
	}
	if int64(len(data)) != size {
		return nil, fmt.Errorf("node %s sent %d bytes of %s, the record says %d", cc.ch.peer, len(data), ref, size)
	}
	return data, nil
}

// inline reports whether a pull reads e through the control channel: a
// small host object (a GPU object's bytes are staged by its holder and
// read with UCX).
func inline(e Entry) bool { return !e.GPU && e.Size > 0 && e.Size <= MaxInline }

// readInline reads t's object whole from the first holder that serves it
// (each holder tried is marked in tried, why it failed in t.failed), and
// checks every chunk. data is nil when no holder served it: the pull goes
// on with the holders not tried (those that do not serve "read").
func (p *Puller) readInline(ctx context.Context, t *transfer, tried map[string]bool) (data []byte, err error) {
	e := t.e
	for _, h := range e.Holders {
		if tried[h] {
			continue
		}
		data, err := p.readFrom(ctx, e, h)
		if errors.Is(err, errNoInline) {
			continue
		}
		tried[h] = true
		if err == nil {
			if sums := Checksums(data, e.ChunkSize); !slices.Equal(sums, e.Sums) {
				err = fmt.Errorf("%w: the replica read from node %s does not match its record's checksums", ErrChecksum, h)
			}
		}
		if err != nil {
			t.holderFailed(h, err)
			if errors.Is(err, ErrUnavailable) {
				return nil, fmt.Errorf("pull %s: %w", e.Ref(), err)
			}
			p.log().Debug("cluster pull: inline read failed", "object", e.Ref().String(), "node", h, "err", err)
			continue
		}
		return data, nil
	}
	return nil, nil
}

// readFrom reads e's replica from holder over the pooled control channel,
// bounded by the chunk timeout. A pooled channel that fails at the
// transport level is dropped and the node dialled once more.
func (p *Puller) readFrom(ctx context.Context, e Entry, holder string) ([]byte, error) {
	timeout := p.ChunkTimeout
	if timeout <= 0 {
		timeout = DefaultChunkTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for attempt := 0; ; attempt++ {
		pe, err := p.acquire(ctx, holder)
		if err != nil {
			return nil, err
		}
		data, err := pe.cc.Read(ctx, e.Ref(), e.ID, e.Size)
		stale := errors.Is(err, errChannel)
		p.release(pe, stale)
		if err == nil || !stale || attempt > 0 || ctx.Err() != nil {
			return data, err
		}
	}
}
