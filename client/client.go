package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// ErrClosed is returned by calls on a Client after Close.
var ErrClosed = errors.New("client closed")

// Client is a connection to the store daemon. Its methods are safe for
// concurrent use.
//
// One goroutine at a time reads the packets the daemon sends (it holds the
// read role: reader.go) and hands each reply to the call that waits for it
// (by request id) and each event to the subscribers. A call that finds
// nobody reading reads its own reply, with no hand-off between goroutines;
// while no call is in flight a background goroutine reads, so events and
// the end of the connection are seen. A get that waits for a seal holds up
// nothing else: whoever reads delivers every reply.
type Client struct {
	conn   *protocol.Conn
	socket string
	server ServerInfo

	sendMu sync.Mutex // one sender at a time on conn
	// registerMu keeps a registration's staged descriptors and its
	// register together (external.go).
	registerMu sync.Mutex

	mu      sync.Mutex
	nextID  uint64
	pending map[uint64]chan reply // calls waiting for their reply
	// sending are the pending calls whose request is not sent yet: the
	// read role is never handed to one (blocked sending, it would read
	// nothing while the daemon may be blocked sending to this client).
	sending   map[uint64]struct{}
	abandoned map[uint64]string // calls whose caller gave up (value: object name); the reply is cleaned up
	subs      map[*subscription]struct{}
	arenas    map[arenaKey]*arena
	gpu       map[gpuUser]struct{} // Objects and Leases with an open GPU mapping
	err       error                // why the connection ended; nil while it lives
	closed    bool                 // Close was called
	role      readRole             // who reads the connection (reader.go)
	// noCopy is, per name, the last no-copy version published without
	// descriptors (nocopy.go), republished counts republishes (for tests).
	noCopy      map[string]noCopySent
	republished int

	parked      parking                  // idle GPU arenas kept mapped (park.go)
	hostMaps    map[hostKey]*hostMapping // registered host memory mapped (hostext.go)
	progress    map[uint64]func(int)     // kv_reads under way: their progress callbacks, by request id (kvread.go)
	hostClock   uint64
	table       *leaseTable   // the lease fast path (fastpath.go); nil without one
	callTimeout time.Duration // bounds the calls that take no context
	spin        time.Duration // a call reading its own reply polls this long first (0: never)
	idleRead    *time.Timer   // starts the background reader (reader.go)
	readerDone  chan struct{} // closed once the connection has ended
	endOnce     sync.Once
	notices     notices   // readers' notices not taken yet (notice.go)
	bulk        bulkCache // memfds for the arrays of block requests (kvpool.go)
}

// Defaults for the zero values of Options.
const (
	// DefaultDialTimeout bounds Dial (connect and handshake) when its
	// context has no earlier deadline.
	DefaultDialTimeout = 10 * time.Second
	// DefaultCallTimeout bounds the calls that take no context:
	// Lease.Release, and Close's wait for the daemon to end the connection.
	DefaultCallTimeout = 30 * time.Second
	// DefaultSpin is how long a call waiting for its own reply polls the
	// socket before it sleeps (Options.Spin).
	DefaultSpin = 50 * time.Microsecond
)

// Options configure a Client (DialOptions). The zero value is the default.
type Options struct {
	// DialTimeout bounds connecting and the handshake, so that a daemon
	// that does not answer (stopped, overloaded) fails Dial with ErrTimeout
	// instead of hanging; the context's deadline applies when earlier.
	// 0 means DefaultDialTimeout; a negative value leaves only the context.
	DialTimeout time.Duration
	// CallTimeout bounds the calls that take no context: Lease.Release
	// waits at most this long for the daemon's acknowledgement, Close at
	// most this long for the daemon to end the connection. 0 means
	// DefaultCallTimeout. Calls that take a context are bounded by it.
	CallTimeout time.Duration
	// MaxIdleArenas bounds the GPU arenas this client keeps mapped after
	// their last Object or Lease ended, so that the next Get in one costs
	// no driver open (least recently used go first). Each is one driver
	// mapping of a daemon arena (its memory is the daemon's, already
	// allocated). 0 means DefaultMaxIdleArenas; negative keeps none, and then
	// releases GPU leases through the socket rather than keeping them idle
	// for the lease fast path.
	MaxIdleArenas int
	// NoFastPath turns the lease fast path off: every Release and Get goes
	// through the socket (for comparison; docs/architecture.md).
	NoFastPath bool
	// Spin is how long a call that reads its own reply (the read role:
	// docs/architecture.md, "The round trip") keeps polling the socket
	// before its goroutine sleeps in the netpoller, so that a reply that
	// comes within it costs no wake-up: it spends up to this much CPU per
	// call. 0 means DefaultSpin; negative turns polling off (the
	// environment variable CUDAIPC_SPIN, a duration such as "50us" or "0",
	// overrides both).
	Spin time.Duration
}

// reply is what the reader hands to a waiting call. The placement in a
// create or get reply has already been mapped by the reader (m), so that
// the arena cache follows the daemon's record of what this connection was
// sent even when the caller has gone.
type reply struct {
	resp *storev1.Response
	m    *mapping // mapping holding the placement, with a reference for the caller
	// files are the descriptors of a GPU placement's region (a vmm-fd
	// arena's one, or registered memory's, one per piece) or the lease
	// table's; the caller closes them.
	files []*os.File
	// manifest is a bundle's manifest memfd (the packet's last
	// descriptor); the caller closes it.
	manifest *os.File
	err      error // mapping failed, or the connection ended
	// lead hands the read role to the waiting call instead of a reply
	// (reader.go).
	lead bool
}

// Dial connects to the daemon at socket ("" means DefaultSocketPath) and
// performs the handshake, with the default Options. If there is no daemon
// the error wraps ErrStoreGone; if the daemon does not admit this user,
// ErrPermission; if it does not answer within DefaultDialTimeout (or ctx's
// deadline), ErrTimeout.
func Dial(ctx context.Context, socket string) (*Client, error) {
	return DialOptions(ctx, socket, Options{})
}

// DialOptions is Dial with options.
func DialOptions(ctx context.Context, socket string, opts Options) (*Client, error) {
	if socket == "" {
		socket = DefaultSocketPath()
	}
	if opts.DialTimeout == 0 {
		opts.DialTimeout = DefaultDialTimeout
	}
	if opts.CallTimeout <= 0 {
		opts.CallTimeout = DefaultCallTimeout
	}
	if opts.DialTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, opts.DialTimeout)
		defer cancel()
	}
	conn, err := protocol.Dial(ctx, socket)
	if err != nil {
		return nil, dialError(socket, err)
	}
	if opts.MaxIdleArenas == 0 {
		opts.MaxIdleArenas = DefaultMaxIdleArenas
	}
	spin, err := spinOption(opts.Spin)
	if err != nil {
		conn.Close()
		return nil, err
	}
	c := &Client{
		parked:      parking{max: opts.MaxIdleArenas, byID: make(map[uint64]*parkedArena)},
		callTimeout: opts.CallTimeout,
		spin:        spin,
		conn:        conn,
		socket:      socket,
		nextID:      1,
		pending:     make(map[uint64]chan reply),
		sending:     make(map[uint64]struct{}),
		abandoned:   make(map[uint64]string),
		subs:        make(map[*subscription]struct{}),
		arenas:      make(map[arenaKey]*arena),
		gpu:         make(map[gpuUser]struct{}),
		readerDone:  make(chan struct{}),
	}
	if err := c.handshake(ctx); err != nil {
		conn.Close()
		return nil, err
	}
	c.idleRead = time.AfterFunc(idleReadDelay, c.readIdle)
	if !opts.NoFastPath {
		c.openLeaseTable(ctx)
	}
	return c, nil
}

// spinOption is the polling window of Options.Spin, CUDAIPC_SPIN.
func spinOption(d time.Duration) (time.Duration, error) {
	if v, ok := os.LookupEnv("CUDAIPC_SPIN"); ok && v != "" {
		e, err := time.ParseDuration(v)
		if err != nil {
			return 0, &Error{Op: "dial", Message: fmt.Sprintf("CUDAIPC_SPIN=%q is not a duration (e.g. 50us, or 0 for none)", v), Err: ErrInvalid}
		}
		d = max(e, -1)
		if d == 0 {
			d = -1
		}
	}
	switch {
	case d == 0:
		return DefaultSpin, nil
	case d < 0:
		return 0, nil
	}
	return d, nil
}

func dialError(socket string, err error) error {
	e := &Error{Op: "dial", Message: fmt.Sprintf("%s: %v", socket, err), Err: ErrStoreGone}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		e.cause = errno // for callers that word their own message
	}
	switch {
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		e.Err = ErrPermission
	case errors.Is(err, context.DeadlineExceeded):
		e.Err, e.cause = ErrTimeout, context.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		e.Err = err
	}
	return e
}

func (c *Client) handshake(ctx context.Context) error {
	name := filepath.Base(os.Args[0]) + "[" + strconv.Itoa(os.Getpid()) + "]"
	if len(name) > protocol.MaxClientNameLen {
		name = name[len(name)-protocol.MaxClientNameLen:]
	}
	h, err := protocol.ClientHello(ctx, c.conn, name)
	if err != nil {
		return c.handshakeError(ctx, err)
	}
	c.nextID = 2 // the hello was request 1
	c.server = ServerInfo{Version: h.GetVersion(), ServerVersion: h.GetServerVersion(), PID: int(h.GetPid()), Backend: h.GetBackend(), PeerUID: h.GetPeerUid(), Node: h.GetNode()}
	return nil
}

func (c *Client) handshakeError(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		if errors.Is(cerr, context.DeadlineExceeded) {
			return &Error{Op: "dial", Err: ErrTimeout, Message: fmt.Sprintf("the daemon at %s did not answer the handshake in time (is it stopped or overloaded?)", c.socket), cause: cerr}
		}
		return &Error{Op: "dial", Err: cerr}
	}
	var ce *protocol.CodeError
	if errors.As(err, &ce) {
		return &Error{Op: "dial", Err: protocol.Sentinel(ce.Code), Message: ce.Message, Limit: limitName(ce.Limit)}
	}
	if errors.Is(err, protocol.ErrVersion) {
		return &Error{Op: "dial", Err: ErrVersion, Message: err.Error()}
	}
	msg := fmt.Sprintf("%s: %v", c.socket, err)
	if errors.Is(err, io.EOF) {
		// The daemon hangs up on peers it does not admit.
		msg = fmt.Sprintf("the daemon at %s closed the connection during the handshake (is this uid admitted? see 'cudaipc serve --allow-uid')", c.socket)
	}
	return &Error{Op: "dial", Err: ErrStoreGone, Message: msg}
}

// Server returns what the daemon said about itself in the handshake.
func (c *Client) Server() ServerInfo { return c.server }

// Socket returns the path of the daemon's socket.
func (c *Client) Socket() string { return c.socket }

// Close closes the connection. Objects not yet sealed are aborted by the
// daemon and leases are released: when Close returns, the daemon has done
// so, and every connection sees those leases gone and their memory
// reusable (Close waits for the daemon to end the connection, at most
// Options.CallTimeout; past that it closes the socket without waiting and
// the guarantee does not hold). Host memory of Objects and Leases not yet
// sealed or released stays mapped until they are; Close unmaps the rest.
// GPU mappings of Objects and Leases (legacy IPC mappings and imported
// arenas alike) are closed first (their ReadAt and WriteAt fail
// afterwards, Ptr is 0), because the daemon may free that memory once the
// connection is gone. Close is idempotent.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	users := make([]gpuUser, 0, len(c.gpu))
	for u := range c.gpu {
		users = append(users, u)
	}
	clear(c.gpu)
	c.mu.Unlock()
	for _, u := range users {
		u.closeGPU()
	}
	c.dropIdleArenas(nil)
	c.unparkAll()
	// Half-close and wait for the daemon to hang up: it cleans up the
	// session (aborts, releases) before it closes its end, so once the
	// reader sees the end of the stream other connections see the cleanup.
	if c.conn.CloseWrite() == nil {
		c.idleRead.Reset(0) // someone must read up to the end
		t := time.NewTimer(c.callTimeout)
		select {
		case <-c.readerDone:
		case <-t.C:
		}
		t.Stop()
	}
	err := c.conn.Close()
	c.idleRead.Reset(0)
	<-c.readerDone
	c.idleRead.Stop()
	c.closeLeaseTable()
	c.mu.Lock()
	c.releaseArenasLocked()
	c.dropHostMapsLocked()
	c.mu.Unlock()
	c.bulk.close()
	return err
}

// readOne reads one packet and dispatches it: an event to the
// subscribers, a reply to the call that waits for it (or, for an
// abandoned call, to cleanup). A reply to self is returned instead, with
// mine set. It is called by the holder of the read role only. An error
// ends the connection (fail), except a read deadline that interrupted the
// holder (reader.go), which is returned as is.
func (c *Client) readOne(self uint64, spin time.Duration) (r reply, mine bool, err error) {
	resp := new(storev1.Response)
	files, err := c.conn.RecvSpin(resp, spin)
	if err == nil {
		err = protocol.ValidateResponse(resp, len(files))
	}
	if err != nil {
		closeFiles(files)
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			c.fail(err)
		}
		return reply{}, false, err
	}
	if resp.GetId() == 0 {
		closeFiles(files)
		if ev := resp.GetEvent(); ev != nil {
			c.dispatch(ev)
		}
		if n := resp.GetNotice(); n != nil {
			c.notices.push(n)
		}
		if af := resp.GetArenasFreed(); af != nil {
			// Unmapping can take a driver call: not on the reader.
			go c.arenasFreed(af.GetArenaIds())
		}
		return reply{}, false, nil
	}
	if c.progressed(resp) {
		closeFiles(files)
		return reply{}, false, nil
	}
	r = reply{resp: resp}
	if manifestAttached(resp) && len(files) > 0 && responseError("", "", resp) == nil {
		r.manifest, files = files[len(files)-1], files[:len(files)-1]
	}
	// Host placements are mapped here, so that the arena cache follows
	// what the daemon sent even when the caller has gone; GPU placements
	// (a region, and a descriptor beside a vmm-fd one, in every placement)
	// need no per-connection state and are imported by the caller.
	p := placementOf(resp)
	switch {
	case resp.GetLeaseTable() != nil && len(files) == 1, resp.GetFiles() != nil, resp.GetPoolStat() != nil:
		r.files = files
	case p == nil || responseError("", "", resp) != nil:
		closeFiles(files)
	case p.GetKind() == storev1.Placement_HOST && !p.GetExternal():
		r.m, r.err = c.place(p, files)
	case p.GetKind() == storev1.Placement_VMM_FD, p.GetExternal():
		r.files = files // holds checks their number
	default:
		closeFiles(files)
	}
	id := resp.GetId()
	c.mu.Lock()
	ch, ok := c.pending[id]
	delete(c.pending, id)
	name, gaveUp := c.abandoned[id]
	delete(c.abandoned, id)
	c.mu.Unlock()
	switch {
	case ok && id == self:
		return r, true, nil
	case ok:
		ch <- r // buffered, and empty: only the reader fills it
	case gaveUp:
		c.cleanup(r, name)
	default:
		c.drop(r) // a reply to no request of ours
	}
	return reply{}, false, nil
}

// fail ends the connection: every waiting call and later call gets
// ErrStoreGone (or ErrClosed after Close), and subscriptions end.
func (c *Client) fail(cause error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return
	}
	if c.closed {
		c.err = ErrClosed
	} else {
		c.err = fmt.Errorf("%w: %v", ErrStoreGone, cause)
		c.conn.Close()
	}
	for id, ch := range c.pending {
		if c.role.reading && c.role.leader == id {
			continue // it holds the read role: it sees the error itself
		}
		ch <- reply{err: c.err}
		delete(c.pending, id)
	}
	for s := range c.subs {
		s.end()
		delete(c.subs, s)
	}
	c.endOnce.Do(func() { close(c.readerDone) })
}

// drop gives back what a reply holds: its reference to a host arena's
// mapping and the descriptors that came with it.
func (c *Client) drop(r reply) {
	if r.m != nil {
		c.unref(r.m)
	}
	closeFiles(r.files)
	if r.manifest != nil {
		r.manifest.Close()
	}
}

// cleanup undoes the effect of a reply nobody waits for any more: a lease
// is released, a created object aborted.
func (c *Client) cleanup(r reply, name string) {
	c.drop(r)
	resp := r.resp
	if resp == nil || responseError("", "", resp) != nil {
		return
	}
	var req *storev1.Request
	switch {
	case resp.GetGet() != nil:
		req = &storev1.Request{Body: &storev1.Request_Release{Release: &storev1.ReleaseRequest{LeaseId: resp.GetGet().GetLeaseId()}}}
	case resp.GetCreate() != nil && name != "":
		// For a shard, the daemon aborts its version whichever shard
		// index the abort names.
		req = &storev1.Request{Body: &storev1.Request_Abort{Abort: &storev1.AbortRequest{Name: name, Version: resp.GetCreate().GetVersion()}}}
	case resp.GetBlockGet().GetPin() != 0, resp.GetBlockLookup().GetPin() != 0:
		pin := max(resp.GetBlockGet().GetPin(), resp.GetBlockLookup().GetPin())
		req = &storev1.Request{Body: &storev1.Request_BlockUnpin{BlockUnpin: &storev1.BlockUnpinRequest{Pin: pin}}}
	default:
		return
	}
	go func() { _ = c.sendDetached(req) }()
}

// sendDetached sends req and ignores its reply.
func (c *Client) sendDetached(req *storev1.Request) error {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return c.err
	}
	req.Id = c.nextID
	c.nextID++
	c.abandoned[req.Id] = ""
	c.mu.Unlock()
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	return c.conn.Send(req)
}

// roundTrip sends req and waits for its reply. When ctx ends first the
// call is abandoned: its reply, when it comes, is cleaned up by the reader.
// Every call but a waiting get (GetOptions.Wait: it may wait for a seal as
// long as its caller likes) is bounded by the call timeout when ctx has no deadline, so a
// daemon that stopped answering cannot hang it.
func (c *Client) roundTrip(ctx context.Context, op, name string, req *storev1.Request) (reply, error) {
	return c.roundTripFiles(ctx, op, name, req, nil)
}

// roundTripFiles is roundTrip with descriptors attached to the request
// (register); the caller keeps and closes its copies.
func (c *Client) roundTripFiles(ctx context.Context, op, name string, req *storev1.Request, files []*os.File) (reply, error) {
	// The call timeout is a deadline, not a derived context: the caller
	// that reads its own reply makes it the socket's read deadline, which
	// costs no allocation (reader.go).
	deadline, ok := ctx.Deadline()
	if !ok && (op != "get" || req.GetGet().GetTimeoutMs() == 0) {
		deadline = time.Now().Add(c.callTimeout)
	}
	if err := ctx.Err(); err != nil {
		return reply{}, ctxError(op, name, err)
	}
	ch := make(chan reply, 1)
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return reply{}, &Error{Op: op, Name: name, Err: err}
	}
	id := c.nextID
	c.nextID++
	req.Id = id
	c.pending[id] = ch
	c.sending[id] = struct{}{}
	c.mu.Unlock()

	c.sendMu.Lock()
	err := c.conn.Send(req, files...)
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
			gone = fmt.Errorf("%w: %v", ErrStoreGone, err)
		}
		return reply{}, &Error{Op: op, Name: name, Err: gone}
	}
	return c.await(call{ctx: ctx, deadline: deadline, op: op, name: name, id: id, ch: ch})
}

// ctxError is the error of a call whose context ended: a passed deadline
// matches ErrTimeout and context.DeadlineExceeded.
func ctxError(op, name string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) {
		return &Error{Op: op, Name: name, Err: ErrTimeout, Message: "no answer from the daemon before the deadline", cause: err}
	}
	return &Error{Op: op, Name: name, Err: err}
}

// responseError converts the daemon's error, if any, to an *Error.
func responseError(op, name string, resp *storev1.Response) error {
	e := resp.GetError()
	if e.GetCode() == storev1.Error_OK {
		return nil
	}
	return &Error{Op: op, Name: name, Message: e.GetMessage(), Err: protocol.Sentinel(e.GetCode()), Limit: limitName(e.GetLimit())}
}

// limitName is Error.Limit's text: "" for an unspecified limit.
func limitName(l storev1.Error_Limit) string {
	if l == storev1.Error_LIMIT_UNSPECIFIED {
		return ""
	}
	return l.String()
}

func placementOf(resp *storev1.Response) *storev1.Placement {
	if g := resp.GetGet(); g != nil {
		return g.GetPlacement()
	}
	if cr := resp.GetCreate(); cr != nil {
		return cr.GetPlacement()
	}
	return nil
}

func closeFiles(files []*os.File) { protocol.CloseFiles(files) }

// manifestAttached reports whether a reply's last descriptor is a
// bundle's manifest.
func manifestAttached(resp *storev1.Response) bool {
	return resp.GetCreate().GetManifestAttached() || resp.GetGet().GetManifestAttached()
}
