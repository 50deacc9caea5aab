package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/protocol"
)

// Reads of KV spaces across nodes (docs/kv.md, "Across nodes"): a reader's
// daemon asks the daemon a space is registered on to expose the regions a
// read uses ("kvopen" on the control channel, with the reader's uid: the
// holder serves only regions that uid may read by the store's rules), then
// reads the read's byte ranges straight from them with the data plane's
// Get, several in flight, and releases the exposure ("close"). Nothing is
// written to the directory and no replica is made.

// ErrSpaceUnreachable: the node a KV space is on could not be read from
// (refused, dropped the connection, stalled, or died mid-read). Code
// UNAVAILABLE.
var ErrSpaceUnreachable = class("the node of the KV space could not be read from", protocol.ErrUnavailable)

// ErrNoSpace: the node has no such KV space for the reader: never, or no
// longer (its engine ended or closed it), or registered again since the
// description, or not readable by the reader's uid. Code NOT_FOUND.
var ErrNoSpace = class("no such KV space for this reader", protocol.ErrNotFound)

// DefaultSpaceDepth is how many of a space read's Gets are in flight at
// once when SpaceRead.Depth is 0.
const DefaultSpaceDepth = 16

// SpaceSource is a Source that also exposes registered KV spaces to
// readers on other nodes ("kvopen"). A Source without it answers "kvopen"
// as an unknown op.
type SpaceSource interface {
	// ExposeSpace exposes regions of the KV space whose description is
	// desc (kv.Desc's binary encoding) to a reader of uid reader: each
	// stays registered, and readable at the returned places, until
	// release. It fails with an error wrapping ErrNotFound when this node
	// has no such space (never, or no longer, or registered again since),
	// or the reader may not read it: ErrNoSpace.
	//
	// With stage, it exposes instead one buffer into which it gathers the
	// blocks stage names, as kv.Staging lays them out (regions are the
	// regions those layers use), each layer readable as soon as it is
	// gathered: reads of bytes not gathered yet wait at this node.
	ExposeSpace(reader uint32, desc []byte, regions []int, stage *SpaceStage) (e SpaceExposure, release func(), err error)
}

// SpaceGatherer is a SpaceSource that also answers a small staged read
// with its bytes, in the control channel's answer ("kvread"): one round
// trip, no exposure to release, no UCX transfer.
type SpaceGatherer interface {
	// GatherSpace appends to dst the bytes a staged read of stage gathers
	// (as ExposeSpace with stage would expose them), at most max of them,
	// and returns the extended slice, failing as ExposeSpace does.
	GatherSpace(reader uint32, desc []byte, regions []int, stage *SpaceStage, max int64, dst []byte) ([]byte, error)
}

// SpaceNotifier is a SpaceSource that also queues notices from readers on
// other nodes for the engines of its spaces ("kvnotify": a read of the
// space ended).
type SpaceNotifier interface {
	// NotifySpace queues payload from a reader of uid reader for the
	// engine of the space whose description is desc, failing with an
	// error wrapping ErrNoSpace when this node has no such space for the
	// reader, or its engine's connection ended.
	NotifySpace(reader uint32, desc, payload []byte) error
}

// maxNoticePayload bounds a "kvnotify"'s payload (protocol.MaxNoticePayload).
const maxNoticePayload = 4096

// serveSpaceNotify answers a "kvnotify" request.
func (s *ControlServer) serveSpaceNotify(req ctlRequest) ctlResponse {
	var resp ctlResponse
	sn, ok := s.Source.(SpaceNotifier)
	switch {
	case !ok:
		resp.Err = fmt.Sprintf("%s %q", unknownOp, req.Op)
	case len(req.Space) == 0 || len(req.Payload) > maxNoticePayload:
		resp.Err = fmt.Sprintf("kvnotify of a description of %d bytes with a payload of %d", len(req.Space), len(req.Payload))
	default:
		if err := sn.NotifySpace(req.Reader, req.Space, req.Payload); err != nil {
			resp.Err, resp.NotHeld = err.Error(), errors.Is(err, ErrNoSpace)
		}
	}
	return resp
}

// NotifySpace asks the node to queue payload, from a reader of uid
// reader, for the engine of the KV space desc. It fails wrapping
// ErrNoSpace as OpenSpace does.
func (cc *ControlClient) NotifySpace(ctx context.Context, reader uint32, desc, payload []byte) error {
	resp, err := cc.roundTrip(ctx, ctlRequest{Op: "kvnotify", Reader: reader, Space: desc, Payload: payload})
	if err != nil {
		return err
	}
	if resp.Err != "" {
		if resp.NotHeld {
			return fmt.Errorf("node %s: %w", cc.ch.peer, errorText{resp.Err, ErrNoSpace})
		}
		return fmt.Errorf("node %s: %s", cc.ch.peer, resp.Err)
	}
	return nil
}

// NotifySpace sends a notice for the engine of the KV space desc to node,
// over the puller's pooled connection to it, failing as GatherSpace does.
func (p *Puller) NotifySpace(ctx context.Context, node string, reader uint32, desc, payload []byte) error {
	for attempt := 0; ; attempt++ {
		pe, err := p.acquire(ctx, node)
		if err != nil {
			if errors.Is(err, errNotLive) {
				return fmt.Errorf("node %s is not a live node of the cluster: %w: %v", node, ErrNotFound, err)
			}
			return unreachable(node, err)
		}
		err = pe.cc.NotifySpace(ctx, reader, desc, payload)
		stale := errors.Is(err, errChannel)
		p.release(pe, stale)
		if err == nil || !stale || attempt > 0 || ctx.Err() != nil {
			if err != nil && !errors.Is(err, ErrNoSpace) {
				err = unreachable(node, err)
			}
			return err
		}
	}
}

// SpaceStage is what a staged read gathers: block Blocks[i] of each part
// of layers [First, First+Count).
type SpaceStage struct {
	Blocks []int `json:"blocks"`
	First  int   `json:"first"`
	Count  int   `json:"count"`
}

// SpaceExposure says where a reader reads the exposed regions of a space:
// through the worker Worker, region regions[i] at Regions[i].
type SpaceExposure struct {
	Worker  []byte
	Regions []SpaceRegion
}

// SpaceRegion is one exposed region of a space: its window key, the
// remote address of its first byte and its size.
type SpaceRegion struct {
	RKey []byte `json:"rkey"`
	Addr uint64 `json:"addr"`
	Size int64  `json:"size"`
}

// maxSpaceRegions bounds the regions of one "kvopen" (kv.MaxRegions).
const maxSpaceRegions = 1024

// serveSpace answers a "kvopen" request: an exposure of the space's
// regions, which the reader releases by handle like an "open".
func (s *ControlServer) serveSpace(req ctlRequest, held *exposures) ctlResponse {
	var resp ctlResponse
	ss, ok := s.Source.(SpaceSource)
	switch {
	case !ok:
		resp.Err = fmt.Sprintf("%s %q", unknownOp, req.Op)
		return resp
	case len(req.Regions) == 0 || len(req.Regions) > maxSpaceRegions || len(req.Space) == 0:
		resp.Err = fmt.Sprintf("kvopen of %d regions of a description of %d bytes", len(req.Regions), len(req.Space))
		return resp
	}
	if st := req.Stage; st != nil && (len(st.Blocks) == 0 || st.First < 0 || st.Count <= 0) {
		resp.Err = fmt.Sprintf("kvopen of a staging of %d blocks of layers from %d, %d of them", len(st.Blocks), st.First, st.Count)
		return resp
	}
	if !held.reserve() {
		resp.Err = fmt.Sprintf("more than %d objects exposed on one connection", MaxExposures)
		return resp
	}
	e, rel, err := ss.ExposeSpace(req.Reader, req.Space, req.Regions, req.Stage)
	if err != nil {
		held.unreserve()
		resp.Err, resp.NotHeld = err.Error(), errors.Is(err, ErrNoSpace)
		return resp
	}
	resp.Handle, resp.Exposure.Worker, resp.Regions = held.add(rel), e.Worker, e.Regions
	return resp
}

// serveSpaceRead answers a "kvread" request: the staged read's bytes
// follow the answer in a frame of their own, sealed like every frame of
// the channel. They are appended to dst, which it returns extended (or
// as it was, for a read that failed).
func (s *ControlServer) serveSpaceRead(req ctlRequest, dst []byte) (ctlResponse, []byte) {
	var resp ctlResponse
	sg, ok := s.Source.(SpaceGatherer)
	st := req.Stage
	switch {
	case !ok:
		resp.Err = fmt.Sprintf("%s %q", unknownOp, req.Op)
		return resp, dst
	case st == nil || len(st.Blocks) == 0 || st.First < 0 || st.Count <= 0 || len(req.Regions) == 0 || len(req.Regions) > maxSpaceRegions:
		resp.Err = "kvread of no staging, or of no regions"
		return resp, dst
	}
	b, err := sg.GatherSpace(req.Reader, req.Space, req.Regions, st, MaxInline, dst)
	if err != nil {
		resp.Err, resp.NotHeld = err.Error(), errors.Is(err, ErrNoSpace)
		return resp, dst
	}
	if n := len(b) - len(dst); n <= 0 || n > MaxInline {
		resp.Err = fmt.Sprintf("a staging of %d bytes cannot be read inline", n)
		return resp, dst
	}
	resp.Inline = int64(len(b) - len(dst))
	return resp, b
}

// GatherSpace asks the node for the bytes of a staged read of the KV
// space desc (size of them, at most MaxInline) in its answer. It fails
// wrapping ErrNoSpace as OpenSpace does.
func (cc *ControlClient) GatherSpace(ctx context.Context, reader uint32, desc []byte, regions []int, stage *SpaceStage, size int64) ([]byte, error) {
	var data []byte
	resp, err := cc.exchange(ctx, ctlRequest{Op: "kvread", Reader: reader, Space: desc, Regions: regions, Stage: stage}, &data)
	if err != nil {
		return nil, err
	}
	if resp.Err != "" {
		if resp.NotHeld {
			return nil, fmt.Errorf("node %s: %w", cc.ch.peer, errorText{resp.Err, ErrNoSpace})
		}
		return nil, fmt.Errorf("node %s: %s", cc.ch.peer, resp.Err)
	}
	if int64(len(data)) != size {
		return nil, fmt.Errorf("%w: node %s sent %d bytes of a staging of %d", ErrBadRecord, cc.ch.peer, len(data), size)
	}
	return data, nil
}

// OpenSpace asks the node to expose regions of the KV space desc to a
// reader of uid reader, and returns where to read them and a handle for
// Release. The node keeps them until Release or until this connection
// closes. It fails wrapping ErrNoSpace when the node has no such space for
// the reader. With stage, the node exposes one buffer of the blocks stage
// names (SpaceSource).
func (cc *ControlClient) OpenSpace(ctx context.Context, reader uint32, desc []byte, regions []int, stage *SpaceStage) (SpaceExposure, uint64, error) {
	resp, err := cc.roundTrip(ctx, ctlRequest{Op: "kvopen", Reader: reader, Space: desc, Regions: regions, Stage: stage})
	if err != nil {
		return SpaceExposure{}, 0, err
	}
	if resp.Err != "" {
		if resp.NotHeld {
			return SpaceExposure{}, 0, fmt.Errorf("node %s: %w", cc.ch.peer, errorText{resp.Err, ErrNoSpace})
		}
		return SpaceExposure{}, 0, fmt.Errorf("node %s: %s", cc.ch.peer, resp.Err)
	}
	e := SpaceExposure{Worker: resp.Exposure.Worker, Regions: resp.Regions}
	want := len(regions)
	if stage != nil {
		want = 1
	}
	if err := e.validate(want); err != nil {
		cc.Release(ctx, resp.Handle) //nolint:errcheck // the answer is refused; the exposure goes with it
		return SpaceExposure{}, 0, fmt.Errorf("node %s: %w", cc.ch.peer, err)
	}
	return e, resp.Handle, nil
}

func (e *SpaceExposure) validate(n int) error {
	if len(e.Worker) == 0 || len(e.Worker) > MaxWorkerAddrLen {
		return fmt.Errorf("%w: worker address of %d bytes", ErrBadRecord, len(e.Worker))
	}
	if len(e.Regions) != n {
		return fmt.Errorf("%w: %d regions exposed, %d asked for", ErrBadRecord, len(e.Regions), n)
	}
	for i, r := range e.Regions {
		if len(r.RKey) == 0 || len(r.RKey) > MaxWorkerAddrLen {
			return fmt.Errorf("%w: region %d: rkey of %d bytes", ErrBadRecord, i, len(r.RKey))
		}
		if r.Size <= 0 || r.Addr+uint64(r.Size) < r.Addr {
			return fmt.Errorf("%w: region %d: %d bytes at %#x", ErrBadRecord, i, r.Size, r.Addr)
		}
	}
	return nil
}

// SpaceRead is one read of a KV space on another node (Puller.ReadSpace):
// the space's description and the regions it reads, and its Gets, which
// Next hands out one after another (false: none left; it is called from
// several goroutines, one at a time) and Done is told of (from several
// goroutines at once) as their bytes are in place.
type SpaceRead struct {
	// Node is the node the space is on, Reader the reading uid.
	Node   string
	Reader uint32
	// Desc is the space's description; Regions the regions read, and
	// Sizes their sizes as the description says.
	Desc    []byte
	Regions []int
	Sizes   []int64
	// Stage, when set, makes the read staged: the node exposes one buffer
	// (SpaceSource), which the Gets read (their Region 0), of Sizes[0]
	// bytes.
	Stage *SpaceStage
	Next  func() (SpaceGet, bool)
	Done  func(SpaceGet)
	// Depth is how many Gets are in flight at once (DefaultSpaceDepth
	// when 0); Timeout bounds each (the puller's ChunkTimeout when 0).
	Depth   int
	Timeout time.Duration
}

// SpaceGet is one Get of a space read: len(Dst) bytes at offset Off of
// region Regions[Region]; Tag is the caller's.
type SpaceGet struct {
	Region int
	Off    int64
	Dst    []byte
	Tag    int
}

// gatherOne reads the staged read r in one "kvread" over the puller's
// pooled connection to r.Node, failing as GatherSpace does.
func (p *Puller) gatherOne(ctx context.Context, r SpaceRead) ([]byte, error) {
	for attempt := 0; ; attempt++ {
		pe, err := p.acquire(ctx, r.Node)
		if err != nil {
			if errors.Is(err, errNotLive) {
				return nil, fmt.Errorf("node %s is not a live node of the cluster: %w: %v", r.Node, ErrNotFound, err)
			}
			return nil, unreachable(r.Node, err)
		}
		b, err := pe.cc.GatherSpace(ctx, r.Reader, r.Desc, r.Regions, r.Stage, r.Sizes[0])
		stale := errors.Is(err, errChannel)
		p.release(pe, stale || errors.Is(err, ErrBadRecord))
		if err == nil || !stale || attempt > 0 || ctx.Err() != nil {
			if err != nil && !errors.Is(err, ErrNoSpace) && !errors.Is(err, ErrBadRecord) {
				err = unreachable(r.Node, err)
			}
			return b, err
		}
	}
}

// ReadSpace reads r over the puller's pooled connection to r.Node: it has
// the node expose the regions, runs the Gets and releases the exposure. A
// node that is not live fails it with an error wrapping ErrNotFound (its
// spaces went with it), one that cannot be reached, or fails mid-read,
// with ErrUnreachable; a space the node does not have, or not for this
// reader, with ErrNotFound. ReadSpace returns once no Get writes into a
// Dst any more.
func (p *Puller) ReadSpace(ctx context.Context, r SpaceRead) error {
	var (
		pe     *peer
		exp    SpaceExposure
		handle uint64
		err    error
	)
	for attempt := 0; ; attempt++ {
		if pe, err = p.acquire(ctx, r.Node); err != nil {
			if errors.Is(err, errNotLive) {
				return fmt.Errorf("node %s is not a live node of the cluster: %w: %v", r.Node, ErrNotFound, err)
			}
			return unreachable(r.Node, err)
		}
		exp, handle, err = pe.cc.OpenSpace(ctx, r.Reader, r.Desc, r.Regions, r.Stage)
		if err == nil {
			break
		}
		stale := errors.Is(err, errChannel)
		p.release(pe, stale)
		if !stale || attempt > 0 || ctx.Err() != nil {
			if errors.Is(err, ErrNoSpace) || errors.Is(err, ErrBadRecord) {
				return err
			}
			return unreachable(r.Node, err)
		}
	}
	bad := false
	defer func() {
		p.bg.Go(func() {
			rctx, cancel := context.WithTimeout(context.Background(), HandshakeTimeout)
			if err := pe.cc.Release(rctx, handle); err != nil {
				bad = true
			}
			cancel()
			p.release(pe, bad)
		})
	}()
	for i, reg := range exp.Regions {
		if reg.Size != r.Sizes[i] {
			return fmt.Errorf("%w: node %s exposes %d bytes (region %d), the read expects %d", ErrBadRecord, r.Node, reg.Size, i, r.Sizes[i])
		}
	}
	ep, err := pe.endpoint(ctx, p.Transport, exp.Worker)
	if err != nil {
		bad = true
		return unreachable(r.Node, fmt.Errorf("connect to its worker: %w", err))
	}
	var mu sync.Mutex
	next := func() (chunkRead, bool) {
		mu.Lock()
		defer mu.Unlock()
		for {
			g, ok := r.Next()
			if !ok {
				return chunkRead{}, false
			}
			if g.Region < 0 || g.Region >= len(exp.Regions) || g.Off < 0 || g.Off+int64(len(g.Dst)) > exp.Regions[g.Region].Size {
				panic(fmt.Sprintf("cluster: space read of [%d, +%d) of region %d", g.Off, len(g.Dst), g.Region))
			}
			if len(g.Dst) == 0 {
				r.Done(g)
				continue
			}
			reg := exp.Regions[g.Region]
			return chunkRead{addr: reg.Addr + uint64(g.Off), dst: g.Dst, first: g.Tag, rkey: reg.RKey, region: g.Region}, true
		}
	}
	done := func(c chunkRead, err error) {
		if err == nil {
			r.Done(SpaceGet{Region: c.region, Off: int64(c.addr - exp.Regions[c.region].Addr), Dst: c.dst, Tag: c.first})
		}
	}
	timeout := r.Timeout
	if timeout <= 0 {
		timeout = p.ChunkTimeout
	}
	if timeout <= 0 {
		timeout = DefaultChunkTimeout
	}
	depth := r.Depth
	if depth <= 0 {
		depth = DefaultSpaceDepth
	}
	if err := readChunks(ctx, ep, nil, depth, timeout, next, done); err != nil {
		if ctx.Err() != nil {
			return err
		}
		bad = true
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("no answer within %v", timeout)
		}
		return unreachable(r.Node, err)
	}
	return nil
}

// errorText is an error of a peer's text that matches a sentinel.
type errorText struct {
	text string
	is   error
}

func (e errorText) Error() string { return e.text }
func (e errorText) Unwrap() error { return e.is }

// unreachable is the error of a space read whose node failed.
func unreachable(node string, err error) error {
	return fmt.Errorf("%w: node %s: %v", ErrSpaceUnreachable, node, err)
}
