package ucx

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync/atomic"
)

// Token names a Window: 16 random bytes, which only the readers its owner
// hands it to know (in the cluster, over the authenticated control
// channel). Fetch requests carry it in the clear: it guards against peers
// that can reach the worker, not against those that watch the wire.
type Token [16]byte

// String returns the token's first bytes in hex, enough to tell tokens
// apart in logs without spelling them out.
func (t Token) String() string { return hex.EncodeToString(t[:4]) + "…" }

// Window is a range of a registered region that peers may Fetch while it
// is open: a served worker answers a fetch only for bytes inside the open
// window its token names. Open one per exposure of an object (its bytes,
// not the whole arena around them) and close it when the exposure ends.
type Window struct {
	r     *MemRegion
	addr  uint64
	n     uint64
	token Token
	// ready is how many of the window's first bytes peers may fetch; a
	// fetch of bytes past them waits (FillingWindow). Atomic, so that
	// Ready takes no lock the served workers' loops take (closed is
	// guarded by r.ctx.mu).
	ready  atomic.Uint64
	closed bool
}

// Window opens a window on n bytes of the region at offset off.
func (r *MemRegion) Window(off, n uint64) (*Window, error) { return r.window(off, n, n) }

// FillingWindow opens a window on n bytes of the region at offset off
// whose bytes are still being written: a fetch of bytes past what Ready
// last said waits at the holder (up to DeferWait, then it is refused)
// instead of reading them, and is answered as soon as they are ready. A
// reader can so start on an object's first bytes while the holder still
// copies the rest in (a GPU object staged device→host after its record
// was published).
func (r *MemRegion) FillingWindow(off, n uint64) (*Window, error) { return r.window(off, n, 0) }

func (r *MemRegion) window(off, n, ready uint64) (*Window, error) {
	if n == 0 || off > r.key.Len || n > r.key.Len-off {
		return nil, fmt.Errorf("ucx: window [%d, +%d) is not inside the region of %d bytes", off, n, r.key.Len)
	}
	w := &Window{r: r, addr: r.key.Addr + off, n: n}
	w.ready.Store(ready)
	if _, err := rand.Read(w.token[:]); err != nil {
		return nil, err
	}
	c := r.ctx
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, open := c.regions[r]; !open {
		return nil, ErrClosed
	}
	c.windows[w.token] = w
	return w, nil
}

// Token returns the token that names the window.
func (w *Window) Token() Token { return w.token }

// Addr returns the remote address of the window's first byte.
func (w *Window) Addr() uint64 { return w.addr }

// Len returns the window's length.
func (w *Window) Len() uint64 { return w.n }

// Ready says that the window's first k bytes (at most its length) hold
// what peers may fetch, and answers the fetches waiting for them. Ready
// never takes bytes back: a k below an earlier one changes nothing.
//
// Ready takes no lock that a served worker's loop holds: a holder staging
// an object calls it after every slice, and waiting for those locks (a
// Serve spinning through a stream of fetches takes its worker's lock again
// at once) kept its copy engine idle most of the time. A Ready
// on a closed window changes nothing that a fetch reads.
func (w *Window) Ready(k uint64) {
	k = min(k, w.n)
	for {
		cur := w.ready.Load()
		if k <= cur {
			return
		}
		if w.ready.CompareAndSwap(cur, k) {
			break
		}
	}
	if ws := w.r.ctx.serving.Load(); ws != nil {
		for _, wk := range *ws {
			wk.wakeServe()
		}
	}
}

// Close closes the window: later fetches of its token are refused. Replies
// under way finish (MemRegion.Close waits for them). It is idempotent.
func (w *Window) Close() error {
	c := w.r.ctx
	c.mu.Lock()
	defer c.mu.Unlock()
	if !w.closed {
		w.closed = true
		delete(c.windows, w.token)
	}
	return nil
}

// errNoWindow is the refusal of a token no open window has.
var errNoWindow = errors.New("no open window has that token (never opened, or closed: the exposure ended)")

// windowFor returns the region of the open window that token names, with
// a Fetch reply counted on it, when [addr, +n) lies inside the window and
// is ready; else nil and, when the bytes are not ready yet, wait, or the
// refusal's reason.
func (c *Context) windowFor(token Token, addr, n uint64) (r *MemRegion, wait bool, why string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	w := c.windows[token]
	switch {
	case w == nil:
		return nil, false, errNoWindow.Error()
	case addr < w.addr || addr+n > w.addr+w.n:
		return nil, false, fmt.Sprintf("[%#x, +%d) is not inside window %v [%#x, +%d)", addr, n, token, w.addr, w.n)
	case addr+n > w.addr+w.ready.Load():
		return nil, true, ""
	}
	w.r.sending.Add(1)
	return w.r, false, ""
}

// closeWindowsLocked closes r's windows; c.mu is held.
func (c *Context) closeWindowsLocked(r *MemRegion) {
	for t, w := range c.windows {
		if w.r == r {
			w.closed = true
			delete(c.windows, t)
		}
	}
}
