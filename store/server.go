package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"os"
	"os/user"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// handshakeTimeout bounds how long a new connection may take to say hello,
// so that idle connections cannot pile up unidentified.
const handshakeTimeout = 10 * time.Second

// Serve accepts connections on l and serves each in its own goroutine until
// ctx is done. It then closes l and every connection (which aborts their
// unsealed objects and releases their leases), waits for them, and returns
// nil. It returns early with an error only if l fails for good.
func (s *Store) Serve(ctx context.Context, l *net.UnixListener) error {
	return s.serve(ctx, l, l.Addr().String())
}

// serve is Serve, logging path as the socket's: ListenAndServe binds under
// a temporary name that l.Addr still reports after the rename.
func (s *Store) serve(ctx context.Context, l *net.UnixListener, path string) error {
	connCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	s.log.Info("serving", "path", path, "backend", s.backend.name(), "gpu_share", s.cfg.GPUShare, "capacity", s.cfg.Capacity, "evict", !s.cfg.NoEvict)

	var backoff time.Duration
	for {
		uc, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				s.log.Info("shutting down", "cause", context.Cause(ctx))
				return nil
			}
			if !temporary(err) {
				return fmt.Errorf("store: accept: %w", err)
			}
			// Out of descriptors or memory: wait for connections to go
			// away rather than spin.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Warn("accept failed; retrying", "err", err, "in", backoff)
			select {
			case <-time.After(backoff):
			case <-ctx.Done():
			}
			continue
		}
		backoff = 0
		wg.Go(func() { s.serveConn(connCtx, uc) })
	}
}

func temporary(err error) bool {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.ECONNABORTED, syscall.EINTR} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// conn is one client connection being served.
type conn struct {
	s   *Store
	c   *protocol.Conn
	ss  *session
	log *slog.Logger

	// order is held from the moment a reply's placement is decided until
	// the reply is sent, so that a reply that omits an arena's descriptor
	// (already sent) never overtakes the reply that carries it.
	order   sync.Mutex
	wg      sync.WaitGroup // waiting gets and the event pump
	pumping bool           // the event pump runs; read and set by the receiving goroutine only
	events  connEvents     // CUDA events seals wait on (sealwait.go)
	kv      kvReads        // kv_reads under way (kvread.go)
}

func (s *Store) serveConn(ctx context.Context, uc *net.UnixConn) {
	c := protocol.NewConn(uc)
	defer c.Close()
	// Shutdown must not wait for a client that dawdles over its hello.
	stopEarly := context.AfterFunc(ctx, func() { c.Close() })
	defer stopEarly()
	cred, err := c.PeerCred()
	if err != nil {
		s.refuse(uc, c, peer{}, "peercred", nil, "no peer credentials", "err", err)
		return
	}
	p := peer{pid: cred.Pid, uid: cred.Uid, gid: cred.Gid}
	// Outsiders are closed at once, before they can hold anything: they
	// never count against the connection limits.
	if !s.authorized(p) {
		s.refuse(uc, c, p, "permission", protocol.Errorf(storev1.Error_PERMISSION,
			"uid %d may not use this store; the daemon admits uid %d, root and those given with --allow-uid/--allow-gid", p.uid, s.uid),
			"not admitted")
		return
	}
	done, reason, lerr := s.admitConn(p.uid)
	if lerr != nil {
		s.refuse(uc, c, p, reason, lerr, "connection limit")
		return
	}
	defer done()
	log := s.logFor(p.uid).With("pid", p.pid, "uid", p.uid)

	hello, ok := s.handshake(uc, c, p, log)
	if !ok {
		return
	}
	ss, err := s.newSession(ctx, p)
	if err != nil {
		c.Send(protocol.ErrorResponse(hello.GetId(), protocol.Errorf(storev1.Error_INTERNAL, "the store is shutting down")))
		return
	}
	log = log.With("session", ss.id)
	cn := &conn{s: s, c: c, ss: ss, log: log}
	// Closing the socket is how a session's end (shutdown, Store.Close, a
	// failed send) interrupts the Recv below.
	stop := context.AfterFunc(ss.ctx, func() { c.Close() })
	defer func() {
		stop()
		ss.close(errSessionClosed)
		cn.wg.Wait()
		if err := cn.events.close(); err != nil {
			log.Warn("closing the connection's CUDA events", "err", err)
		}
	}()
	if err := cn.send(&storev1.Response{Id: hello.GetId(), Body: &storev1.Response_Hello{Hello: &storev1.HelloResponse{
		Version:       protocol.Version,
		ServerVersion: serverVersion(),
		Pid:           uint32(os.Getpid()),
		Backend:       s.backend.name(),
		PeerUid:       cn.ss.peer.uid,
		Node:          s.nodeName(),
	}}}); err != nil {
		return
	}
	cn.wg.Go(cn.tellFreed)
	log.Debug("client connected", "client", hello.GetHello().GetClientName())
	s.metrics.request("hello", "ok")

	for {
		var req storev1.Request
		files, err := c.RecvSpin(&req, max(s.cfg.Spin, 0))
		if err != nil {
			cn.logRecvError(err)
			return
		}
		// At debug level each request logs when it came and when its handler
		// returned (Unix ns: comparable with a client's clock on this host).
		var recvd time.Time
		trace := log.Enabled(ss.ctx, slog.LevelDebug)
		if trace {
			recvd = time.Now()
		}
		if err := protocol.ValidateRequest(&req, len(files)); err != nil {
			protocol.CloseFiles(files)
			op := protocol.RequestKind(&req)
			cn.reply(op, protocol.ErrorResponse(req.GetId(), err), nil)
			bulk := len(files) == 1 && protocol.BlockRequest(&req) // a block request's bulk file
			if len(files) > 0 && req.GetRegister() == nil && req.GetStageFiles() == nil && !bulk || req.GetId() == 0 {
				// Not a bad argument but a client that does not follow the
				// framing rules (docs/protocol.md, section 2); an error
				// with id 0 means the connection closes. Unknown
				// operations, from a newer client, only get INVALID.
				log.Warn("closing connection: protocol violation", "op", op, "err", err)
				return
			}
			continue
		}
		if cn.poolRequest(&req, files) {
			continue
		}
		if r := req.GetRegister(); r != nil {
			cn.registerReply(req.GetId(), r, files)
			continue
		}
		if req.GetStageFiles() != nil {
			cn.stageReply(req.GetId(), files)
			continue
		}
		if len(files) > 0 {
			cn.createWithFiles(&req, files)
			continue
		}
		cn.handle(&req)
		if trace {
			log.Debug("request handled", "op", protocol.RequestKind(&req), "id", req.GetId(),
				"recv_ns", recvd.UnixNano(), "done_ns", time.Now().UnixNano())
		}
	}
}

// handshake reads the client's hello and checks its version and the
// peer's right to connect. On failure it answers with the error and
// reports false.
func (s *Store) handshake(uc *net.UnixConn, c *protocol.Conn, p peer, log *slog.Logger) (*storev1.Request, bool) {
	uc.SetReadDeadline(time.Now().Add(handshakeTimeout))
	var req storev1.Request
	files, err := c.Recv(&req)
	if err != nil {
		s.metrics.rejected.WithLabelValues("handshake").Inc()
		if ok, suppressed := s.refusals.Allow(); ok {
			log.Warn("closing connection: no hello", "err", err, "suppressed", suppressed)
		}
		return nil, false
	}
	uc.SetReadDeadline(time.Time{})
	protocol.CloseFiles(files)
	reject := func(reason string, err error) (*storev1.Request, bool) {
		if ok, suppressed := s.refusals.Allow(); ok {
			log.Warn("rejecting connection", "reason", reason, "err", err, "suppressed", suppressed)
		}
		s.metrics.rejected.WithLabelValues(reason).Inc()
		c.Send(protocol.ErrorResponse(req.GetId(), err))
		return nil, false
	}
	if err := protocol.ValidateRequest(&req, len(files)); err != nil {
		return reject("handshake", err)
	}
	if req.GetHello() == nil {
		return reject("handshake", protocol.Errorf(storev1.Error_INVALID, "the first request must be hello, not %s", protocol.RequestKind(&req)))
	}
	if err := protocol.CheckVersion(req.GetHello().GetVersion()); err != nil {
		return reject("version", err)
	}
	return &req, true
}

// refuse counts and closes a connection the store will not serve, first
// telling the peer why (a connection-level error, id 0) when err is set.
// Log lines are rate-limited: a flood of refused connections must not
// become a flood of logs.
func (s *Store) refuse(uc *net.UnixConn, c *protocol.Conn, p peer, reason string, err error, msg string, args ...any) {
	s.metrics.rejected.WithLabelValues(reason).Inc()
	if ok, suppressed := s.refusals.Allow(); ok {
		args = append(args, "pid", p.pid, "uid", p.uid, "reason", reason, "suppressed", suppressed)
		if err != nil {
			args = append(args, "err", err)
		}
		s.log.Warn("refusing connection: "+msg, args...)
	}
	if err != nil {
		// A new socket's send buffer is empty: this does not block, and
		// the deadline makes sure of it.
		uc.SetWriteDeadline(time.Now().Add(time.Second))
		c.Send(protocol.ErrorResponse(0, err))
	}
}

// admitConn counts a connection of uid against the limits, or says which
// limit it would break. done uncounts it.
func (s *Store) admitConn(uid uint32) (done func(), reason string, err error) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	if s.conns >= s.cfg.MaxConns {
		return nil, "limit_total", protocol.LimitErrorf(storev1.Error_CONNECTIONS,
			"connection limit: the store serves %d connections, its limit (its max-conns setting); try again later", s.conns)
	}
	if n := s.connsByUID[uid]; n >= s.cfg.MaxConnsPerUID {
		return nil, "limit_uid", protocol.LimitErrorf(storev1.Error_CONNECTIONS_PER_UID,
			"connection limit: uid %d already has %d connections, the limit per uid (its max-conns-per-uid setting); close some", uid, n)
	}
	s.conns++
	s.connsByUID[uid]++
	return func() {
		s.connMu.Lock()
		defer s.connMu.Unlock()
		s.conns--
		if s.connsByUID[uid]--; s.connsByUID[uid] == 0 {
			delete(s.connsByUID, uid)
		}
	}, "", nil
}

// authorized reports whether a peer may use the store: root, the daemon's
// own uid, and the uids and groups of Config.AllowUIDs and AllowGIDs.
func (s *Store) authorized(p peer) bool {
	if p.uid == 0 || p.uid == s.uid || slices.Contains(s.cfg.AllowUIDs, p.uid) {
		return true
	}
	if len(s.cfg.AllowGIDs) == 0 {
		return false
	}
	if slices.Contains(s.cfg.AllowGIDs, p.gid) {
		return true
	}
	// Supplementary groups come from the group database, as for a login:
	// the kernel does not pass them with SO_PEERCRED.
	u, err := user.LookupId(strconv.FormatUint(uint64(p.uid), 10))
	if err != nil {
		return false
	}
	gids, err := u.GroupIds()
	if err != nil {
		return false
	}
	for _, g := range gids {
		if n, err := strconv.ParseUint(g, 10, 32); err == nil && slices.Contains(s.cfg.AllowGIDs, uint32(n)) {
			return true
		}
	}
	return false
}

func serverVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return "cudaipc " + bi.Main.Version
	}
	return "cudaipc (devel)"
}

func (cn *conn) logRecvError(err error) {
	var me *protocol.MessageError
	switch {
	case errors.Is(err, io.EOF):
		cn.log.Debug("client disconnected")
	case cn.ss.ctx.Err() != nil:
		cn.log.Debug("connection closed", "cause", context.Cause(cn.ss.ctx))
	case errors.As(err, &me):
		cn.log.Warn("closing connection: bad packet", "err", err)
	default:
		cn.log.Warn("closing connection: receive failed", "err", err)
	}
}

// send sends one response, in order with the others.
func (cn *conn) send(resp *storev1.Response, files ...*os.File) error {
	cn.order.Lock()
	defer cn.order.Unlock()
	return cn.sendLocked(resp, files...)
}

func (cn *conn) sendLocked(resp *storev1.Response, files ...*os.File) error {
	cn.localNames(resp)
	err := cn.c.Send(resp, files...)
	if err != nil {
		if !errors.Is(err, io.EOF) && cn.ss.ctx.Err() == nil {
			cn.log.Warn("closing connection: send failed", "err", err)
		}
		cn.ss.cancel(errSessionClosed)
	}
	return err
}

// reply counts and sends the response to an operation; with p, the
// placement's arena share travels with it and is closed afterwards.
// cn.order must not be held.
func (cn *conn) reply(op string, resp *storev1.Response, p *placement) {
	cn.order.Lock()
	defer cn.order.Unlock()
	cn.replyLocked(op, resp, p)
}

func (cn *conn) replyLocked(op string, resp *storev1.Response, p *placement) {
	result := "ok"
	if code := resp.GetError().GetCode(); code != storev1.Error_OK {
		result = strings.ToLower(code.String())
		cn.log.Debug("request failed", "op", op, "id", resp.GetId(), "code", code.String(), "err", resp.GetError().GetMessage())
	}
	cn.s.metrics.request(op, result)
	var files []*os.File
	if p != nil && p.share != nil && p.share.file != nil {
		files = append(files, p.share.file)
	}
	if p != nil {
		files = append(files, p.pieceFiles...)
	}
	if p != nil && p.manifest != nil {
		files = append(files, p.manifest) // the manifest travels last
	}
	if p != nil {
		defer p.closeShare()
	}
	cn.sendLocked(resp, files...)
}

// handle serves one valid request. Gets that may wait run in their own
// goroutine so the connection keeps serving other requests meanwhile.
func (cn *conn) handle(req *storev1.Request) {
	id, op := req.GetId(), protocol.RequestKind(req)
	fail := func(err error) { cn.reply(op, protocol.ErrorResponse(id, err), nil) }
	ok := func(body *storev1.Response) {
		body.Id = id
		cn.reply(op, body, nil)
	}
	ss := cn.ss
	if err := cn.qualifyNames(req); err != nil {
		fail(err)
		return
	}
	switch b := req.GetBody().(type) {
	case *storev1.Request_Hello:
		fail(protocol.Errorf(storev1.Error_INVALID, "hello is only valid as the first request"))
	case *storev1.Request_Create:
		cn.createReply(id, b.Create, nil)
	case *storev1.Request_Seal:
		if len(b.Seal.GetWaitEvent()) > 0 {
			cn.sealAfterEvent(id, b.Seal)
			return
		}
		if err := cn.seal(b.Seal); err != nil {
			fail(err)
			return
		}
		ok(&storev1.Response{Body: &storev1.Response_Seal{Seal: &storev1.SealResponse{}}})
	case *storev1.Request_Abort:
		if err := ss.abort(b.Abort.GetName(), b.Abort.GetVersion(), b.Abort.GetShard()); err != nil {
			fail(err)
			return
		}
		ok(&storev1.Response{Body: &storev1.Response_Abort{Abort: &storev1.AbortResponse{}}})
	case *storev1.Request_Get:
		r := b.Get
		sel := versionSel{r.GetVersion(), r.GetShard(), r.GetNewerThan()}
		// Granted at once when the object is there (no goroutine on the
		// hot path); a get that may wait for a seal waits in its own, so
		// that it holds up nothing else on the connection.
		fetch := cn.s.cfg.Cluster != nil
		cn.order.Lock()
		done := cn.grant(id, r.GetName(), sel, r.GetTimeoutMs() != 0 || fetch)
		cn.order.Unlock()
		if !done && fetch {
			cn.wg.Go(func() { cn.fetchAndGrant(id, r.GetName(), sel, r.GetTimeoutMs(), r.GetTensors()) })
		} else if !done {
			cn.wg.Go(func() {
				ctx, cancel := cn.getContext(r.GetTimeoutMs())
				defer cancel()
				cn.waitAndGrant(ctx, id, r.GetName(), sel, true, nil)
			})
		}
	case *storev1.Request_Release:
		if err := ss.release(b.Release.GetLeaseId()); err != nil {
			fail(err)
			return
		}
		ok(&storev1.Response{Body: &storev1.Response_Release{Release: &storev1.ReleaseResponse{}}})
	case *storev1.Request_Delete:
		if err := ss.delete(b.Delete.GetName()); err != nil {
			fail(err)
			return
		}
		ok(&storev1.Response{Body: &storev1.Response_Delete{Delete: &storev1.DeleteResponse{}}})
	case *storev1.Request_List:
		infos := ss.list(b.List.GetStartAfter())
		objs := make([]*storev1.ObjectInfo, len(infos))
		for i, in := range infos {
			objs[i] = in.proto()
		}
		cn.reply(op, protocol.ListPage(id, objs), nil)
	case *storev1.Request_Stat:
		in, err := ss.stat(b.Stat.GetName())
		if err != nil {
			fail(err)
			return
		}
		ok(&storev1.Response{Body: &storev1.Response_Stat{Stat: &storev1.StatResponse{Info: in.proto()}}})
	case *storev1.Request_Subscribe:
		events, err := ss.subscribe()
		if err != nil {
			fail(err)
			return
		}
		// The acknowledgement goes out before the first event: the pump
		// starts after it.
		ok(&storev1.Response{Body: &storev1.Response_Subscribe{Subscribe: &storev1.SubscribeResponse{}}})
		if !cn.pumping {
			cn.pumping = true
			cn.wg.Go(func() { cn.pump(events) })
		}
	case *storev1.Request_LeaseTable:
		f, n, err := ss.leaseTable()
		if err != nil {
			fail(err)
			return
		}
		defer f.Close()
		cn.order.Lock()
		defer cn.order.Unlock()
		cn.s.metrics.request(op, "ok")
		cn.sendLocked(&storev1.Response{Id: id, Body: &storev1.Response_LeaseTable{LeaseTable: &storev1.LeaseTableResponse{Slots: uint32(n)}}}, f)
	case *storev1.Request_Withdraw:
		r := b.Withdraw
		cn.wg.Go(func() { cn.withdrawReply(id, r.GetName(), r.GetTimeoutMs()) })
	case *storev1.Request_Notify:
		if err := ss.sendNotice(b.Notify.GetName(), b.Notify.GetPayload()); err != nil {
			fail(err)
			return
		}
		ok(&storev1.Response{Body: &storev1.Response_Notify{Notify: &storev1.NotifyResponse{}}})
	case *storev1.Request_ForgetArenas:
		if err := ss.forget(b.ForgetArenas.GetArenaIds()); err != nil {
			fail(err)
			return
		}
		ok(&storev1.Response{Body: &storev1.Response_ForgetArenas{ForgetArenas: &storev1.ForgetArenasResponse{}}})
	case *storev1.Request_Files:
		cn.filesReply(id, b.Files)
	case *storev1.Request_KvRead:
		cn.kvRead(id, b.KvRead)
	case *storev1.Request_KvCancel:
		cn.kvCancel(id, b.KvCancel)
	case *storev1.Request_KvNotify:
		r := b.KvNotify
		cn.wg.Go(func() { cn.kvNotify(id, r) })
	default:
		fail(protocol.Errorf(storev1.Error_INVALID, "unsupported operation %s", op))
	}
}

// createReply answers a create, which carries files (a no-copy
// version's descriptors: createReply takes them) or none.
func (cn *conn) createReply(id uint64, c *storev1.CreateRequest, files []*os.File) {
	cn.order.Lock()
	defer cn.order.Unlock()
	r := createReqOf(c)
	if r.sourcesSize > 0 {
		// The staged descriptors come first (stage.go).
		files = append(cn.ss.takeStaged(), files...)
	}
	r.files = files
	p, n, err := cn.ss.create(r)
	if err != nil {
		cn.replyLocked("create", protocol.ErrorResponse(id, err), nil)
		return
	}
	cn.replyLocked("create", &storev1.Response{Id: id, Body: &storev1.Response_Create{Create: &storev1.CreateResponse{
		Placement: p.proto(), Version: n, ManifestAttached: p.manifest != nil}}}, &p)
}

// createWithFiles serves a request that carries descriptors and is not a
// register: a no-copy create (protocol.ValidateRequest let nothing else
// through). It takes files.
func (cn *conn) createWithFiles(req *storev1.Request, files []*os.File) {
	c := req.GetCreate()
	if err := cn.qualifyNames(req); err != nil || c == nil {
		protocol.CloseFiles(files)
		if err == nil {
			err = protocol.Errorf(storev1.Error_INVALID, "only create and register carry descriptors")
		}
		cn.reply(protocol.RequestKind(req), protocol.ErrorResponse(req.GetId(), err), nil)
		return
	}
	cn.createReply(req.GetId(), c, files)
}

// tellFreed sends the client the arenas given back that it maps
// (ArenasFreed, id 0) and its readers' notices (Notice, id 0), until the
// session ends.
func (cn *conn) tellFreed() {
	s, ss := cn.s, cn.ss
	for {
		select {
		case <-ss.notify:
		case <-ss.ctx.Done():
			return
		}
		s.mu.Lock()
		ids := ss.takeFreedLocked()
		notices := ss.takeNoticesLocked()
		s.mu.Unlock()
		for _, n := range notices {
			if cn.send(&storev1.Response{Body: &storev1.Response_Notice{Notice: n}}) != nil {
				return
			}
		}
		for len(ids) > 0 {
			n := min(len(ids), protocol.MaxArenaIDs)
			if cn.send(&storev1.Response{Body: &storev1.Response_ArenasFreed{ArenasFreed: &storev1.ArenasFreed{ArenaIds: ids[:n]}}}) != nil {
				return
			}
			ids = ids[n:]
		}
	}
}

// grant answers a get at once: a lease, or the reason there is none. With
// retry, it reports false and sends nothing when the object is not ready.
// cn.order must be held.
func (cn *conn) grant(id uint64, name string, sel versionSel, retry bool) bool {
	p, err := cn.ss.tryGet(name, sel)
	if retry && errors.Is(err, ErrTimeout) {
		return false
	}
	if err != nil {
		cn.replyLocked("get", protocol.ErrorResponse(id, err), nil)
		return true
	}
	in := p.info.proto()
	if len(p.region) > 0 {
		// Once per reply: the object's region is the placement's (the
		// arena's, or registered memory's) at the placement's offset.
		in.Region = nil
	}
	cn.replyLocked("get", &storev1.Response{Id: id, Body: &storev1.Response_Get{Get: &storev1.GetResponse{
		LeaseId:          p.leaseID,
		Placement:        p.proto(),
		Info:             in,
		ManifestAttached: p.manifest != nil,
		LeaseSlot:        uint32(p.leaseSlot),
		LeaseGen:         p.leaseGen,
	}}}, &p)
	return true
}

// getContext is the context of a get that may wait timeoutMs
// milliseconds (forever when negative, or beyond what a Duration holds:
// 292 years): the session's, with the get's deadline.
func (cn *conn) getContext(timeoutMs int64) (context.Context, context.CancelFunc) {
	if timeoutMs < 0 || timeoutMs > math.MaxInt64/int64(time.Millisecond) {
		return context.WithCancel(cn.ss.ctx)
	}
	return context.WithTimeout(cn.ss.ctx, time.Duration(timeoutMs)*time.Millisecond)
}

// grantNow answers a get with a lease on what name holds, and reports
// true, or reports false and sends nothing when nothing readable is
// there.
func (cn *conn) grantNow(id uint64, name string, sel versionSel) bool {
	cn.order.Lock()
	defer cn.order.Unlock()
	return cn.grant(id, name, sel, true)
}

// waitAndGrant answers a get that was not granted at once. With wait, it
// waits until what it names is readable, or until ctx's deadline. Without,
// it answers now: a lease, or missing where nothing readable is there
// (nil: the get's own ErrTimeout).
func (cn *conn) waitAndGrant(ctx context.Context, id uint64, name string, sel versionSel, wait bool, missing error) {
	if !wait {
		cn.order.Lock()
		defer cn.order.Unlock()
		if !cn.grant(id, name, sel, missing != nil) {
			cn.replyLocked("get", protocol.ErrorResponse(id, missing), nil)
		}
		return
	}
	for {
		if err := cn.ss.waitReady(ctx, name, sel); err != nil {
			if cn.ss.ctx.Err() == nil {
				cn.reply("get", protocol.ErrorResponse(id, err), nil)
			}
			return
		}
		// Not ready means deleted or evicted between the wake-up and now:
		// wait on.
		if cn.grantNow(id, name, sel) {
			return
		}
	}
}

// pump sends the session's events until it ends.
func (cn *conn) pump(events <-chan event) {
	for {
		select {
		case e := <-events:
			ev := protocol.NewEvent(e.kind, e.name)
			ev.GetEvent().Version = e.version
			if cn.send(ev) != nil {
				return
			}
		case <-cn.ss.ctx.Done():
			return
		}
	}
}

func (p *placement) proto() *storev1.Placement {
	pp := &storev1.Placement{
		Kind:      p.kind,
		ArenaId:   p.arenaID,
		Device:    p.device,
		Offset:    uint64(p.offset),
		Size:      uint64(p.size),
		ArenaSize: uint64(p.arenaSize),
		Writable:  p.writable,
	}
	if p.share != nil {
		pp.FdAttached = p.share.file != nil
	}
	pp.Region = p.region
	if p.external {
		pp.External, pp.Files = true, uint32(p.files)
	}
	return pp
}

func (in *info) proto() *storev1.ObjectInfo {
	return &storev1.ObjectInfo{
		Name:            in.Name,
		Size:            uint64(in.Size),
		Device:          in.Device,
		Sealed:          in.Sealed,
		Leases:          uint32(in.Leases),
		Shared:          in.Shared,
		OwnerUid:        in.OwnerUID,
		CreatedUnixNano: in.Created.UnixNano(),
		Region:          in.Region,
		Version:         in.Version,
		Shards:          uint32(in.Shards),
		Shard:           uint32(in.Shard),
		ManifestSize:    uint64(in.ManifestSize),
		Tensors:         uint32(in.Tensors),
		Tensor:          in.Tensor,
		External:        in.External,
		Orphaned:        in.Orphaned,
		ExporterBound:   in.ExporterBound,
		SourcesSize:     uint64(in.SourcesSize),
		Space:           in.Space,
		Cluster:         in.Cluster,
		CreatorCanWrite: in.CreatorCanWrite,
		Partial:         in.Partial,
	}
}

// Each uid has a namespace of its own: the store keeps every object under
// its qualified name, "UID:NAME" (protocol.SplitOwner), and a client names
// its own objects bare and other users' qualified. So a user's object can
// neither take nor shadow another user's name, and a reader that names
// "1000:model" gets uid 1000's object or none.

// qualifyNames rewrites the names of a request into the store's qualified
// form, or says why a name is not acceptable.
func (cn *conn) qualifyNames(req *storev1.Request) error {
	var err error
	switch b := req.GetBody().(type) {
	case *storev1.Request_Create:
		b.Create.Name, err = cn.qualify(b.Create.Name, true)
	case *storev1.Request_Seal:
		b.Seal.Name, err = cn.qualify(b.Seal.Name, false)
		if err == nil && b.Seal.Rename != "" {
			b.Seal.Rename, err = cn.qualify(b.Seal.Rename, true)
		}
	case *storev1.Request_Abort:
		b.Abort.Name, err = cn.qualify(b.Abort.Name, false)
	case *storev1.Request_Get:
		r := b.Get
		if r.OwnerUid != nil {
			uid, _, ok := protocol.SplitOwner(r.Name)
			if ok && uid != *r.OwnerUid {
				return protocol.Errorf(storev1.Error_INVALID, "%q names an object of uid %d, but owner uid %d is required", r.Name, uid, *r.OwnerUid)
			}
			if !ok {
				r.Name = protocol.QualifiedName(*r.OwnerUid, r.Name)
			}
		}
		r.Name, err = cn.qualify(r.Name, false)
	case *storev1.Request_Delete:
		b.Delete.Name, err = cn.qualify(b.Delete.Name, false)
	case *storev1.Request_Withdraw:
		b.Withdraw.Name, err = cn.qualify(b.Withdraw.Name, true)
	case *storev1.Request_Stat:
		b.Stat.Name, err = cn.qualify(b.Stat.Name, false)
	case *storev1.Request_Notify:
		b.Notify.Name, err = cn.qualify(b.Notify.Name, false)
	case *storev1.Request_List:
		if b.List.StartAfter != "" {
			b.List.StartAfter, err = cn.qualify(b.List.StartAfter, false)
		}
	}
	return err
}

// qualify returns the qualified form of a name the client sent: a bare name
// is in the caller's namespace. Objects are only created in one's own.
func (cn *conn) qualify(name string, create bool) (string, error) {
	uid, rest, ok := protocol.SplitOwner(name)
	if !ok {
		uid, rest = cn.ss.peer.uid, name
	}
	if create {
		if uid != cn.ss.peer.uid {
			return "", protocol.Errorf(storev1.Error_PERMISSION, "%q names uid %d's namespace: objects are created in their creator's own (uid %d), under a bare name", name, uid, cn.ss.peer.uid)
		}
		if _, _, nested := protocol.SplitOwner(rest); nested {
			return "", protocol.Errorf(storev1.Error_INVALID, "object name %q: a name of the form UID:NAME addresses another uid's objects; choose one that does not start with digits and ':'", rest)
		}
	}
	if len(rest) > protocol.MaxNameLen {
		return "", protocol.Errorf(storev1.Error_INVALID, "object name is %d bytes, at most %d", len(rest), protocol.MaxNameLen)
	}
	return protocol.QualifiedName(uid, rest), nil
}

// localNames rewrites the names in a response as the peer addresses them:
// its own objects bare, other users' qualified.
func (cn *conn) localNames(resp *storev1.Response) {
	uid := cn.ss.peer.uid
	local := func(name string) string {
		if owner, rest, ok := protocol.SplitOwner(name); ok && owner == uid {
			return rest
		}
		return name
	}
	fix := func(in *storev1.ObjectInfo) {
		if in != nil {
			in.Name = local(in.Name)
		}
	}
	switch b := resp.GetBody().(type) {
	case *storev1.Response_Get:
		fix(b.Get.GetInfo())
	case *storev1.Response_List:
		for _, o := range b.List.GetObjects() {
			fix(o)
		}
	case *storev1.Response_Stat:
		fix(b.Stat.GetInfo())
	case *storev1.Response_Register:
		fix(b.Register.GetInfo())
	case *storev1.Response_Event:
		if b.Event != nil {
			b.Event.Name = local(b.Event.Name)
		}
	}
}
