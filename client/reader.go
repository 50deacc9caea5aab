package client

import (
	"context"
	"errors"
	"os"
	"time"
)

// The read role. Exactly one goroutine at a time reads the connection: the
// holder of the read role. A call that sends a request and finds nobody
// reading takes the role and reads until its own reply comes, dispatching
// what else arrives (other calls' replies, events) on the way; so a lone
// call costs one system call to send and one to receive, like a bare
// socket, with no goroutine hand-off. When the holder is done it hands the
// role to another waiting call, or, when none waits, leaves it to the
// background reader, which takes it once the connection has been idle for
// idleReadDelay (so that back-to-back calls never wake it) and reads events,
// freed arenas and the end of the connection meanwhile.
//
// A call that needs the role while the background reader holds it
// interrupts that reader's receive with a read deadline in the past; the
// background reader then hands the role over. A call that holds the role
// makes its own deadline the socket's read deadline, and a context that
// can be cancelled interrupts its receive the same way (context.AfterFunc).
// Whoever gives the role up clears the read deadline, so the next holder's
// receive blocks again.

// idleReadDelay is how long the connection must be idle (no call in
// flight) before the background reader takes the read role: events and
// freed arenas that arrive right after a call wait at most this long.
const idleReadDelay = 500 * time.Microsecond

// readRole says who reads the connection; guarded by Client.mu.
type readRole struct {
	reading     bool   // the role is held (or handed to a waiting call)
	leader      uint64 // the id of the call holding it; 0: the background reader
	interrupted bool   // the holder's receive was interrupted (a deadline in the past)
	deadline    bool   // the socket has a read deadline (the holder's, or an interrupt)
}

// call is a request sent and waiting for its reply.
type call struct {
	ctx      context.Context
	deadline time.Time // zero: none beyond ctx
	op, name string
	id       uint64
	ch       chan reply // buffered: the reply, or the read role (reply.lead)
}

// interruptLocked makes the holder's receive return at once.
func (c *Client) interruptLocked() {
	if c.role.interrupted || !c.role.reading {
		return
	}
	c.role.interrupted, c.role.deadline = true, true
	_ = c.conn.SetReadDeadline(time.Unix(1, 0))
}

// handOffLocked gives up the read role: to a waiting call, or, when none
// waits, to the background reader once the connection is idle.
func (c *Client) handOffLocked() {
	if c.role.deadline {
		_ = c.conn.SetReadDeadline(time.Time{})
	}
	c.role = readRole{}
	if c.err != nil {
		return
	}
	for id, ch := range c.pending {
		if _, unsent := c.sending[id]; unsent {
			continue
		}
		// Its channel is empty: replies come from the holder of the role.
		c.role = readRole{reading: true, leader: id}
		ch <- reply{lead: true}
		return
	}
	if c.closed {
		c.idleRead.Reset(0) // Close waits for the end of the connection
		return
	}
	c.idleRead.Reset(idleReadDelay)
}

// await waits for the reply to call cl, sent already, reading it itself
// when nobody else reads.
func (c *Client) await(cl call) (reply, error) {
	c.mu.Lock()
	delete(c.sending, cl.id)
	_, waiting := c.pending[cl.id] // else its reply is (about to be) in cl.ch
	if waiting && c.err == nil && !c.role.reading {
		c.role = readRole{reading: true, leader: cl.id}
		c.mu.Unlock()
		return c.lead(cl)
	}
	if waiting && c.role.reading && c.role.leader == 0 {
		c.interruptLocked() // the background reader: it hands the role over
	}
	c.mu.Unlock()
	var expired <-chan time.Time
	if !cl.deadline.IsZero() {
		t := time.NewTimer(time.Until(cl.deadline))
		defer t.Stop()
		expired = t.C
	}
	select {
	case r := <-cl.ch:
		if r.lead {
			return c.lead(cl)
		}
		return finish(cl, r)
	case <-cl.ctx.Done():
		c.abandon(cl)
		return reply{}, ctxError(cl.op, cl.name, cl.ctx.Err())
	case <-expired:
		c.abandon(cl)
		return reply{}, ctxError(cl.op, cl.name, context.DeadlineExceeded)
	}
}

// abandon gives up waiting for cl's reply: the reader cleans it up when it
// comes. A read role handed to the call meanwhile is passed on.
func (c *Client) abandon(cl call) {
	c.mu.Lock()
	_, stillPending := c.pending[cl.id]
	if stillPending {
		delete(c.pending, cl.id)
		c.abandoned[cl.id] = cl.name
	}
	if c.role.reading && c.role.leader == cl.id {
		<-cl.ch // the role, sent under c.mu
		c.handOffLocked()
	}
	c.mu.Unlock()
	if !stillPending {
		// The reply (or the connection's end) raced with the deadline;
		// it is in ch.
		c.cleanup(<-cl.ch, cl.name)
	}
}

// lead reads, holding the read role, until cl's reply comes or its
// context or deadline ends, then hands the role on.
func (c *Client) lead(cl call) (reply, error) {
	if !cl.deadline.IsZero() {
		c.mu.Lock()
		c.role.deadline = true
		_ = c.conn.SetReadDeadline(cl.deadline)
		c.mu.Unlock()
	}
	if cl.ctx.Done() != nil {
		stop := context.AfterFunc(cl.ctx, func() {
			c.mu.Lock()
			if c.role.reading && c.role.leader == cl.id {
				c.interruptLocked()
			}
			c.mu.Unlock()
		})
		defer stop()
	}
	for {
		r, mine, err := c.readOne(cl.id, c.spin)
		switch {
		case mine:
			c.mu.Lock()
			c.handOffLocked()
			c.mu.Unlock()
			return finish(cl, r)
		case err == nil:
			continue
		case errors.Is(err, os.ErrDeadlineExceeded):
			c.mu.Lock()
			cause := cl.ctx.Err()
			if cause == nil && !cl.deadline.IsZero() && !time.Now().Before(cl.deadline) {
				cause = context.DeadlineExceeded
			}
			if cause == nil {
				// Not for this call (an interrupt that came late): read on.
				c.role.interrupted = false
				_ = c.conn.SetReadDeadline(cl.deadline)
				c.mu.Unlock()
				continue
			}
			if _, ok := c.pending[cl.id]; ok {
				delete(c.pending, cl.id)
				c.abandoned[cl.id] = cl.name
			}
			c.handOffLocked()
			c.mu.Unlock()
			return reply{}, ctxError(cl.op, cl.name, cause)
		default: // the connection ended (readOne called fail)
			c.mu.Lock()
			delete(c.pending, cl.id)
			gone := c.err
			c.handOffLocked()
			c.mu.Unlock()
			return reply{}, &Error{Op: cl.op, Name: cl.name, Err: gone}
		}
	}
}

// finish turns a reply into the call's result.
func finish(cl call, r reply) (reply, error) {
	if r.err != nil {
		return reply{}, &Error{Op: cl.op, Name: cl.name, Err: r.err}
	}
	if err := responseError(cl.op, cl.name, r.resp); err != nil {
		return reply{}, err
	}
	return r, nil
}

// readIdle is the background reader: it takes the read role when nobody
// holds it and reads until a call wants the role or the connection ends.
func (c *Client) readIdle() {
	c.mu.Lock()
	if c.role.reading || c.err != nil {
		c.mu.Unlock()
		return
	}
	c.role = readRole{reading: true}
	c.mu.Unlock()
	for {
		_, _, err := c.readOne(0, 0) // never polls: it waits for events
		c.mu.Lock()
		if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) || c.role.interrupted {
			c.handOffLocked()
			c.mu.Unlock()
			return
		}
		c.mu.Unlock()
	}
}
