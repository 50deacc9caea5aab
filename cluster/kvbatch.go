package cluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
)

// Small staged reads of KV spaces batched between two daemons. A small read
// ("kvread") costs both daemons a request, its answer and their wake-ups,
// far more than its bytes. So while gatherLanes reads to one node are under
// way, the next wait, and whichever lane frees first sends those waiting as
// one "kvreads" request (at most maxGatherBatch reads, maxGatherBatchBytes
// bytes): the source's daemon gathers each, and answers them in one frame.
// A read alone, or among few, goes at once on its own: batching adds no
// wait, it only gathers what waits anyway.

const (
	// gatherLanes is how many small-read requests to one node are under
	// way before the next reads wait to go together.
	gatherLanes = 4
	// maxGatherBatch and maxGatherBatchBytes bound one "kvreads".
	maxGatherBatch      = 256
	maxGatherBatchBytes = 4 * MaxInline
)

// ctlSpaceRead is one read of a "kvreads" request: as the fields of the
// same names of a "kvread".
type ctlSpaceRead struct {
	Reader  uint32      `json:"reader,omitempty"`
	Space   []byte      `json:"space"`
	Regions []int       `json:"regions"`
	Stage   *SpaceStage `json:"stage"`
}

// ctlSpaceAnswer answers one read of a "kvreads": its bytes' length in the
// frame after the answer (the reads' bytes in order), or why it failed.
type ctlSpaceAnswer struct {
	Size    int64  `json:"size,omitempty"`
	Err     string `json:"err,omitempty"`
	NotHeld bool   `json:"not_held,omitempty"`
}

// serveSpaceReads answers a "kvreads" request: each read as "kvread"
// answers it, their bytes one after the other in the frame after the
// answer, appended to dst (returned extended).
func (s *ControlServer) serveSpaceReads(req ctlRequest, dst []byte) (ctlResponse, []byte) {
	var resp ctlResponse
	if len(req.Batch) == 0 || len(req.Batch) > maxGatherBatch {
		resp.Err = fmt.Sprintf("kvreads of %d reads, want 1 to %d", len(req.Batch), maxGatherBatch)
		return resp, dst
	}
	s.kvBatches.Add(1)
	out := dst
	resp.Batch = make([]ctlSpaceAnswer, len(req.Batch))
	for i, r := range req.Batch {
		a, b := s.serveSpaceRead(ctlRequest{Op: "kvread", Reader: r.Reader, Space: r.Space, Regions: r.Regions, Stage: r.Stage}, out)
		if a.Err == "" && len(b)-len(dst) > maxGatherBatchBytes {
			a.Err = fmt.Sprintf("kvreads of more than %d bytes", maxGatherBatchBytes)
		}
		if a.Err != "" {
			resp.Batch[i] = ctlSpaceAnswer{Err: a.Err, NotHeld: a.NotHeld}
			continue
		}
		resp.Batch[i].Size = int64(len(b) - len(out))
		out = b
	}
	if n := len(out) - len(dst); n > 0 {
		resp.Inline = int64(n)
		return resp, out[len(dst):]
	}
	return resp, nil
}

// gatherQueue is a node's small reads: how many requests are under way
// (busy, at most gatherLanes), and the reads waiting to go together.
type gatherQueue struct {
	busy    int
	waiting []*gatherWait
	// serial: the node answers no "kvreads" (an older daemon): its reads
	// go one a request.
	serial bool
}

// gatherWait is a small read waiting in a queue.
type gatherWait struct {
	r    SpaceRead
	done chan gatherResult // buffered: the read's bytes or error
}

type gatherResult struct {
	b   []byte
	err error
}

// gatherBatches are a puller's queues, by node.
type gatherBatches struct {
	mu sync.Mutex
	q  map[string]*gatherQueue
}

// GatherSpace reads the staged read r (r.Stage, of r.Sizes[0] bytes, at
// most MaxInline) in one answer over the puller's pooled connection to
// r.Node (SpaceGatherer), failing as ReadSpace does; r's Gets are not
// used. Reads to one node under way side by side go together (see above).
func (p *Puller) GatherSpace(ctx context.Context, r SpaceRead) ([]byte, error) {
	gb := &p.gathers
	gb.mu.Lock()
	if gb.q == nil {
		gb.q = map[string]*gatherQueue{}
	}
	q := gb.q[r.Node]
	if q == nil {
		q = &gatherQueue{}
		gb.q[r.Node] = q
	}
	if q.busy < gatherLanes || q.serial {
		q.busy++
		gb.mu.Unlock()
		b, err := p.gatherOne(ctx, r)
		p.gatherNext(r.Node, q)
		return b, err
	}
	w := &gatherWait{r: r, done: make(chan gatherResult, 1)}
	q.waiting = append(q.waiting, w)
	gb.mu.Unlock()
	select {
	case res := <-w.done:
		return res.b, res.err
	case <-ctx.Done():
		gb.mu.Lock()
		for i, o := range q.waiting {
			if o == w {
				q.waiting = append(q.waiting[:i], q.waiting[i+1:]...)
				break
			}
		}
		gb.mu.Unlock()
		return nil, unreachable(r.Node, ctx.Err())
	}
}

// gatherNext ends a request to node: the reads waiting go as one request
// (on a goroutine of their own), or the lane frees.
func (p *Puller) gatherNext(node string, q *gatherQueue) {
	gb := &p.gathers
	gb.mu.Lock()
	if len(q.waiting) == 0 {
		q.busy--
		if q.busy == 0 {
			delete(gb.q, node)
		}
		gb.mu.Unlock()
		return
	}
	n, bytes := 0, int64(0)
	for n < len(q.waiting) && n < maxGatherBatch && (n == 0 || bytes+q.waiting[n].r.Sizes[0] <= maxGatherBatchBytes) {
		bytes += q.waiting[n].r.Sizes[0]
		n++
	}
	batch := q.waiting[:n:n]
	q.waiting = q.waiting[n:]
	gb.mu.Unlock()
	p.bg.Go(func() {
		p.gatherBatch(node, q, batch)
		p.gatherNext(node, q)
	})
}

// gatherBatch reads the waiting reads of batch as one "kvreads" (one
// alone as a "kvread"), each bounded by the chunk timeout.
func (p *Puller) gatherBatch(node string, q *gatherQueue, batch []*gatherWait) {
	ctx, cancel := context.WithTimeout(context.Background(), p.chunkTimeout())
	defer cancel()
	if len(batch) == 1 {
		b, err := p.gatherOne(ctx, batch[0].r)
		batch[0].done <- gatherResult{b, err}
		return
	}
	res, err := p.gatherMany(ctx, node, batch)
	if errors.Is(err, errNoBatch) {
		p.gathers.mu.Lock()
		q.serial = true
		p.gathers.mu.Unlock()
		var wg sync.WaitGroup
		for _, w := range batch {
			wg.Go(func() {
				b, err := p.gatherOne(ctx, w.r)
				w.done <- gatherResult{b, err}
			})
		}
		wg.Wait()
		return
	}
	for i, w := range batch {
		if err != nil {
			w.done <- gatherResult{nil, err}
			continue
		}
		w.done <- res[i]
	}
}

// errNoBatch: the node does not serve "kvreads".
var errNoBatch = errors.New("the node does not serve kvreads")

// gatherMany sends batch as one "kvreads" over the pooled connection to
// node (dialled once more if found broken), and returns each read's
// result; err is the request's failure, which fails every read.
func (p *Puller) gatherMany(ctx context.Context, node string, batch []*gatherWait) ([]gatherResult, error) {
	req := ctlRequest{Op: "kvreads", Batch: make([]ctlSpaceRead, len(batch))}
	for i, w := range batch {
		req.Batch[i] = ctlSpaceRead{Reader: w.r.Reader, Space: w.r.Desc, Regions: w.r.Regions, Stage: w.r.Stage}
	}
	for attempt := 0; ; attempt++ {
		pe, err := p.acquire(ctx, node)
		if err != nil {
			if errors.Is(err, errNotLive) {
				return nil, fmt.Errorf("node %s is not a live node of the cluster: %w: %v", node, ErrNotFound, err)
			}
			return nil, unreachable(node, err)
		}
		var data []byte
		resp, err := pe.cc.exchange(ctx, req, &data)
		if err == nil {
			err = checkBatch(pe.cc.ch.peer, resp, batch, data)
		}
		stale := errors.Is(err, errChannel)
		p.release(pe, stale || errors.Is(err, ErrBadRecord))
		switch {
		case err == nil:
		case strings.HasPrefix(resp.Err, unknownOp):
			return nil, errNoBatch
		case !stale || attempt > 0 || ctx.Err() != nil:
			if !errors.Is(err, ErrBadRecord) {
				err = unreachable(node, err)
			}
			return nil, err
		default:
			continue
		}
		out := make([]gatherResult, len(batch))
		at := int64(0)
		for i, a := range resp.Batch {
			switch {
			case a.Err != "" && a.NotHeld:
				out[i].err = fmt.Errorf("node %s: %w", node, errorText{a.Err, ErrNoSpace})
			case a.Err != "":
				out[i].err = unreachable(node, errors.New(a.Err))
			default:
				out[i].b = data[at : at+a.Size : at+a.Size]
				at += a.Size
			}
		}
		return out, nil
	}
}

// checkBatch checks the answer to a "kvreads" of batch and its bytes.
func checkBatch(peer string, resp ctlResponse, batch []*gatherWait, data []byte) error {
	if resp.Err != "" {
		return fmt.Errorf("node %s: %s", peer, resp.Err)
	}
	if len(resp.Batch) != len(batch) {
		return fmt.Errorf("%w: node %s answered %d reads of %d", ErrBadRecord, peer, len(resp.Batch), len(batch))
	}
	total := int64(0)
	for i, a := range resp.Batch {
		if a.Err != "" {
			continue
		}
		if a.Size != batch[i].r.Sizes[0] {
			return fmt.Errorf("%w: node %s sent %d bytes of a staging of %d", ErrBadRecord, peer, a.Size, batch[i].r.Sizes[0])
		}
		total += a.Size
	}
	if total != int64(len(data)) {
		return fmt.Errorf("%w: node %s sent %d bytes for reads of %d", ErrBadRecord, peer, len(data), total)
	}
	return nil
}

// chunkTimeout bounds one request for bytes: ChunkTimeout, or its default.
func (p *Puller) chunkTimeout() time.Duration {
	if p.ChunkTimeout > 0 {
		return p.ChunkTimeout
	}
	return DefaultChunkTimeout
}
