package client

import (
	"context"
	"time"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// SpaceRead is a read of blocks of a KV space registered on another node of
// the daemon's cluster into a KV space this client's uid registered with
// the daemon (package kv builds it: kv.ReadBlocks; docs/kv.md, "Across
// nodes"): the descriptions' binary encodings, the block ids and the
// layers [First, First+Count) (Count 0: every layer from First).
type SpaceRead struct {
	Src, Dst             []byte
	SrcBlocks, DstBlocks []uint32
	First, Count         int
}

// ReadSpace sends r as one kv_read request and waits for its end: the
// daemon reads the source's bytes from the node that holds them straight
// into the destination's memory. progress, when not nil, is called with
// how many layers from First are complete each time that grows; it is
// called from the goroutine that reads the connection, so it must not
// block or call the client. When ctx ends first, ReadSpace asks the daemon
// to stop (kv_cancel) and waits, up to the call timeout, for the read to
// end, so that once it returns nothing writes into the destination any
// more unless the daemon did not answer in time; it then returns ctx's
// error.
func (c *Client) ReadSpace(ctx context.Context, r SpaceRead, progress func(layers int)) error {
	req := &storev1.Request{Body: &storev1.Request_KvRead{KvRead: &storev1.KvReadRequest{
		Src: r.Src, Dst: r.Dst, SrcBlocks: r.SrcBlocks, DstBlocks: r.DstBlocks,
		First: uint32(r.First), Count: uint32(r.Count),
	}}}
	if d, ok := ctx.Deadline(); ok {
		req.GetKvRead().TimeoutMs = max(time.Until(d).Milliseconds(), 1)
	}
	if err := ctx.Err(); err != nil {
		return ctxError("kv_read", "", err)
	}
	ch := make(chan reply, 1)
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return &Error{Op: "kv_read", Err: err}
	}
	id := c.nextID
	c.nextID++
	req.Id = id
	c.pending[id] = ch
	c.sending[id] = struct{}{}
	if progress != nil {
		if c.progress == nil {
			c.progress = map[uint64]func(int){}
		}
		c.progress[id] = progress
	}
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		delete(c.progress, id)
		c.mu.Unlock()
	}()
	c.sendMu.Lock()
	err := c.conn.Send(req)
	c.sendMu.Unlock()
	if err != nil {
		c.mu.Lock()
		delete(c.pending, id)
		delete(c.sending, id)
		if c.role.reading && c.role.leader == id {
			<-ch // the read role, handed over meanwhile: pass it on
			c.handOffLocked()
		}
		gone := c.err
		c.mu.Unlock()
		if gone == nil {
			gone = err
		}
		return &Error{Op: "kv_read", Err: gone}
	}
	// The wait outlives ctx: when ctx ends the daemon is asked to stop,
	// and the read's end is waited for up to the call timeout.
	wctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	defer stop()
	canceled := context.AfterFunc(ctx, func() {
		_ = c.sendDetached(&storev1.Request{Body: &storev1.Request_KvCancel{KvCancel: &storev1.KvCancelRequest{ReadId: id}}})
		time.AfterFunc(c.callTimeout, stop)
	})
	defer canceled()
	_, err = c.await(call{ctx: wctx, op: "kv_read", id: id, ch: ch})
	if cerr := ctx.Err(); cerr != nil {
		return ctxError("kv_read", "", cerr)
	}
	return err
}

// progressed hands a kv_read's progress response to its callback and
// reports whether resp was one (it is then consumed: the call goes on
// waiting for the read's end).
func (c *Client) progressed(resp *storev1.Response) bool {
	kr := resp.GetKvRead()
	if kr == nil || kr.GetDone() || resp.GetError().GetCode() != storev1.Error_OK {
		return false
	}
	c.mu.Lock()
	f := c.progress[resp.GetId()]
	c.mu.Unlock()
	if f != nil {
		f(int(kr.GetLayers()))
	}
	return true
}
