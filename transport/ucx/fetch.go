package ucx

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync/atomic"
	"time"

	raw "github.com/cudaipc/cudaipc/internal/ucx"
	"golang.org/x/sys/unix"
)

// Fetch is the two-sided read: the reader asks, the holder sends.
//
// Over tcp UCX emulates a GET with messages the holder's worker answers,
// and a reader that dies mid-answer can abort the holder's process
// (docs/cluster.md, "Known crashes in UCX"). Fetch instead sends the holder
// a tagged request, and its Serve answers with a tagged send of the bytes
// from its registered memory into the reader's posted receive (rendezvous
// for large messages). Both are requests of the caller's own, which UCX
// fails when the peer dies, and the holder serves only bytes inside a
// Window it opened, named by a token it hands to the readers it chose.
//
// The request is an envelope (wire.go) of magic "ucFR": its header is the
// reply tag (8), the address (8) and the length (8) of the bytes wanted,
// and the window's token (16); its payload the reader's raw worker
// address, which the holder connects back to. The holder answers with the bytes under the reply tag, or with
// a short error text under the reply tag with fetchReplyErr set.
var magicFetch = [4]byte{'u', 'c', 'F', 'R'}

// Tags of the fetch protocol. Requests carry fetchRequestTag exactly;
// replies fetchReplyBase plus a sequence number of the reader's worker (and
// fetchReplyErr for a refusal), so that they never match a request. The
// sequence number's low 30 bits count the worker's requests; with
// fetchReplyHasSN set, bits 30-45 are the connection sequence number of
// the reader's endpoint that sent the request (Worker.nextSNLocked), and
// the holder replies on its endpoint of the same number, which UCX paired
// with that one (fetchServer.peerLocked). Readers of before set neither
// (their count never reached 2^30 bits' worth of requests); holders of
// before took all 47 bits as one number: both interwork.
const (
	fetchRequestTag   uint64 = 0xC1DA << 48
	fetchReplyBase    uint64 = 0xC1DB << 48
	fetchReplyErr     uint64 = 1 << 47
	fetchReplySeq     uint64 = fetchReplyErr - 1
	fetchReplyHasSN   uint64 = 1 << 46
	fetchReplySNShift        = 30
	fetchReplySN      uint64 = maxConnSN << fetchReplySNShift
	fetchReplyCount   uint64 = 1<<fetchReplySNShift - 1
	fetchHeaderLen           = 40
	// MaxFetchRequest bounds a fetch request: the holder receives requests
	// into buffers of this size.
	MaxFetchRequest = 4096
	// fetchRecvs is how many request receives a serving worker keeps
	// posted; more requests wait in UCX's unexpected queue.
	fetchRecvs = 16
	// maxFetchPeers bounds the endpoints a serving worker keeps to
	// readers; beyond it, idle ones are closed.
	maxFetchPeers = 256
	// maxRefusal bounds a refusal's text.
	maxRefusal = 512
)

// fetchRequest is a decoded request.
type fetchRequest struct {
	replyTag uint64
	addr     uint64
	n        uint64
	token    Token
	reader   WorkerAddress
}

func (r fetchRequest) marshal() []byte {
	hdr := make([]byte, 0, fetchHeaderLen)
	hdr = binary.LittleEndian.AppendUint64(hdr, r.replyTag)
	hdr = binary.LittleEndian.AppendUint64(hdr, r.addr)
	hdr = binary.LittleEndian.AppendUint64(hdr, r.n)
	hdr = append(hdr, r.token[:]...)
	return seal(magicFetch, r.reader.ucxMajor, r.reader.ucxMinor, hdr, r.reader.b)
}

// parseFetchRequest decodes and checks a request from a peer: an error
// matching ErrMalformed for anything that is not one.
func parseFetchRequest(b []byte) (fetchRequest, error) {
	major, minor, hdr, payload, err := open("fetch request", magicFetch, fetchHeaderLen, b, MaxFetchRequest)
	if err != nil {
		return fetchRequest{}, err
	}
	r := fetchRequest{
		replyTag: binary.LittleEndian.Uint64(hdr),
		addr:     binary.LittleEndian.Uint64(hdr[8:]),
		n:        binary.LittleEndian.Uint64(hdr[16:]),
		token:    Token(hdr[24:40]),
	}
	bad := func(format string, args ...any) error {
		return &MalformedError{What: "fetch request", Reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case r.replyTag&^(fetchReplySeq) != fetchReplyBase:
		return fetchRequest{}, bad("reply tag %#x is not a fetch reply tag", r.replyTag)
	case r.n == 0:
		return fetchRequest{}, bad("asks for 0 bytes")
	case r.addr+r.n < r.addr:
		return fetchRequest{}, bad("[%#x, +%d) wraps around the address space", r.addr, r.n)
	}
	if err := checkAddress(payload); err != nil {
		return fetchRequest{}, err
	}
	r.reader = WorkerAddress{ucxMajor: major, ucxMinor: minor, b: payload}
	return r, nil
}

// FetchOptions tune Fetch. The zero value gives the defaults.
type FetchOptions struct {
	// Chunk is the size of one request; 0 means DefaultFetchChunk.
	Chunk int
	// Depth is how many requests are in flight at once; 0 means
	// DefaultDepth.
	Depth int
	// CancelWait bounds how long a canceled Fetch waits for the replies
	// under way; 0 means DefaultCancelWait.
	CancelWait time.Duration
	// Token names the holder's Window that the bytes lie in.
	Token Token
}

// DefaultFetchChunk is FetchOptions.Chunk's default: rendezvous transfers
// cost a round trip each, so they are larger than a Get's.
const DefaultFetchChunk = 8 << 20

// Fetch reads len(dst) bytes at remoteAddr of the peer's region behind key
// into dst, asking the peer's served worker (Serve) to send them, in
// chunks with several in flight; see the comment on magicFetch for why
// this, not Get, is the read to use over tcp. The read must lie inside the
// key's region (ErrOutOfBounds), and the peer sends only bytes inside the
// open Window that opt.Token names (else the error, matching ErrRefused,
// quotes its refusal). When
// ctx ends, the receives the peer has not begun to answer are canceled and
// Fetch waits up to opt.CancelWait, then purgeWait, for the others: when it
// returns with ctx's error UCX no longer writes into dst, unless the error
// says otherwise. The worker drains the replies the peer sends later to
// canceled receives (fetchDrain) while it is progressed: by Serve, or by
// later reads on it. A peer that dies fails Fetch with an error
// IsPeerFailure recognizes.
func Fetch(ctx context.Context, ep *Endpoint, key *RemoteKey, remoteAddr uint64, dst []byte, opt FetchOptions) error {
	l, ok, err := newReadLoop(ctx, ep, key, remoteAddr, uint64(len(dst)), readLimits{opt.Chunk, opt.Depth, opt.CancelWait, DefaultFetchChunk})
	if !ok {
		return err
	}
	var pin runtime.Pinner
	pin.Pin(&dst[0])
	defer pin.Unpin()
	f := &fetchOps{dst: dst, base: raw.Addr(dst), remoteAddr: remoteAddr, token: opt.Token,
		recvParam: raw.RequestParam{OpAttrMask: raw.OpAttrFlagNoImmCmpl}}
	defer f.pins.Unpin()
	err = l.run(ctx, f)
	runtime.KeepAlive(dst)
	return err
}

// fetchOps are a Fetch's steps in readLoop: each chunk is a tagged receive
// into dst and the request that asks the peer to send to it. A failed or
// stopped Fetch cancels the receives the peer has not begun to answer; the
// replies it sends them later are drained (fetchDrain).
type fetchOps struct {
	dst        []byte
	base       uint64 // dst's address
	remoteAddr uint64
	token      Token
	recvParam  raw.RequestParam
	ops        []*fetchOp
	pins       runtime.Pinner // the requests' bytes, while UCX sends them
}

// fetchOp is one chunk of a Fetch in flight.
type fetchOp struct {
	off, end   uint64
	tag        uint64
	recv, send raw.Request
	msg        []byte // the request, kept until its send completes
	canceled   bool   // the receive was canceled
	unanswered bool   // it ended canceled, before any reply matched it
	sendFailed bool   // the request may not have reached the peer
}

func (f *fetchOps) issue(l *readLoop, from, end uint64) error {
	w, ep := l.ep.w, l.ep
	o := &fetchOp{off: from, end: end}
	w.fetchSeq++
	o.tag = replyTag(w.fetchSeq, ep.sn)
	req, err := raw.TagRecvNbx(w.h, f.base+o.off, o.end-o.off, o.tag, ^fetchReplyErr, &f.recvParam)
	if err != nil {
		return err
	}
	o.recv = req
	o.msg = fetchRequest{replyTag: o.tag, addr: f.remoteAddr + o.off, n: o.end - o.off, token: f.token, reader: w.addr}.marshal()
	f.pins.Pin(&o.msg[0])
	sreq, err := raw.TagSendNbx(ep.h, raw.Addr(o.msg), uint64(len(o.msg)), fetchRequestTag, &raw.RequestParam{})
	f.ops = append(f.ops, o)
	if err != nil {
		o.sendFailed = true
		return err
	}
	o.send = sreq
	return nil
}

func (f *fetchOps) inflight() int { return len(f.ops) }

// halt cancels the receives still waiting: what UCX has not matched ends at
// once.
func (f *fetchOps) halt(l *readLoop) {
	for _, o := range f.ops {
		if o.recv != 0 && !o.canceled {
			raw.RequestCancel(l.ep.w.h, o.recv)
			o.canceled = true
		}
	}
}

func (f *fetchOps) reap(l *readLoop) {
	kept := f.ops[:0]
	for _, o := range f.ops {
		if o.send != 0 {
			if s := raw.RequestCheckStatus(o.send); s != raw.InProgress {
				raw.RequestFree(o.send)
				o.send = 0
				if s != raw.OK {
					o.sendFailed = true
					l.fail(&raw.Error{Func: "ucp_tag_send_nbx", Status: s})
				}
			}
		}
		if o.recv != 0 {
			var info raw.TagRecvInfo
			s := raw.TagRecvRequestTest(o.recv, &info)
			if s != raw.InProgress {
				raw.RequestFree(o.recv)
				o.recv = 0
				switch {
				case s == raw.ErrCanceled && o.canceled:
					o.unanswered = true
				case s != raw.OK:
					l.fail(&raw.Error{Func: "ucp_tag_recv_nbx", Status: s})
				case info.SenderTag&fetchReplyErr != 0:
					text := f.dst[o.off : o.off+min(info.Length, o.end-o.off)]
					l.fail(fmt.Errorf("%w: %s", ErrRefused, text))
				case info.Length != o.end-o.off:
					l.fail(fmt.Errorf("ucx: the peer sent %d bytes for a fetch of %d", info.Length, o.end-o.off))
				}
			}
		}
		switch {
		case o.recv != 0 || o.send != 0:
			kept = append(kept, o)
		case o.unanswered && !o.sendFailed:
			l.ep.w.drainLocked(l.ep, o.tag)
		}
	}
	clear(f.ops[len(kept):])
	f.ops = kept
}

func (f *fetchOps) stalled(l *readLoop) error {
	if !time.Now().After(l.giveUp.Add(purgeWait)) {
		return nil
	}
	// Replies the peer began (rendezvous under way) did not finish: give
	// the requests back to UCX, which releases each when it completes, and
	// say that dst is not safe.
	left := len(f.ops)
	for _, o := range f.ops {
		for _, r := range []raw.Request{o.recv, o.send} {
			if r != 0 {
				raw.RequestFree(r)
			}
		}
	}
	f.ops = nil
	return fmt.Errorf("%w; %d replies were still under way %v after the fetch stopped and may still write into dst", l.stopped, left, l.cancelWait+purgeWait)
}

// fetchDrain is a truncating receive a worker posts for the reply to a
// canceled fetch whose request was sent: the holder answers it all the same,
// and unmatched, that reply would stay in the reader's unexpected queue and
// keep a rendezvous send pending at the holder. A receive of drainLen bytes
// on the same reply tag takes the reply without its bytes and completes both
// sides (UCX truncates an eager reply and acknowledges a rendezvous one
// unread: docs/lab/ucx-data-plane.md, "Drains"). Drains complete while the
// worker is progressed; a worker keeps at most maxDrains, and one whose
// reply never comes is canceled when its endpoint or worker closes.
type fetchDrain struct {
	req raw.Request
	ep  *Endpoint // the endpoint the request went by
}

const (
	// drainLen is the length of a drain's receive, shorter than any
	// rendezvous message; an eager reply that fits completes it as well.
	drainLen = 8
	// maxDrains bounds the drains a worker keeps.
	maxDrains = 128
)

// drainLocked posts a drain for the reply under tag to a request sent by
// ep; w.mu is held.
func (w *Worker) drainLocked(ep *Endpoint, tag uint64) {
	if ep.closed || ep.failed.Load() != 0 {
		return
	}
	if w.drainBuf == nil {
		// Shared by the worker's drains (nothing reads it) and unmapped
		// after the worker is destroyed: UCX may write into it until then.
		// It lies outside Go's heap, as a Pinner held that long would
		// panic when a Worker leaked with its Context were collected.
		buf, err := unix.Mmap(-1, 0, unix.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			slog.Debug("ucx: cannot drain the reply to a canceled fetch", "err", err)
			return
		}
		w.drainBuf = buf
	}
	if len(w.drains) >= maxDrains {
		// The oldest: canceled unless a reply matched it, and then
		// released by UCX when it completes.
		d := w.drains[0]
		raw.RequestCancel(w.h, d.req)
		raw.RequestFree(d.req)
		w.drainsDropped++
		w.drains = append(w.drains[:0], w.drains[1:]...)
	}
	p := raw.RequestParam{OpAttrMask: raw.OpAttrFlagNoImmCmpl}
	req, err := raw.TagRecvNbx(w.h, raw.Addr(w.drainBuf), drainLen, tag, ^fetchReplyErr, &p)
	if err != nil {
		slog.Debug("ucx: cannot drain the reply to a canceled fetch", "err", err)
		return
	}
	w.drains = append(w.drains, fetchDrain{req: req, ep: ep})
	if raw.RequestCheckStatus(req) != raw.InProgress {
		w.reapDrainsLocked() // the reply was waiting
	}
}

// reapDrainsLocked releases the drains that completed; w.mu is held.
func (w *Worker) reapDrainsLocked() {
	kept := w.drains[:0]
	for _, d := range w.drains {
		s := raw.RequestCheckStatus(d.req)
		if s == raw.InProgress {
			kept = append(kept, d)
			continue
		}
		raw.RequestFree(d.req)
		if s == raw.OK || s == raw.ErrMessageTruncated {
			w.drainsDone++
		} else {
			w.drainsDropped++
		}
	}
	clear(w.drains[len(kept):])
	w.drains = kept
}

// cancelDrainsLocked cancels the drains of requests sent by ep, or all
// when ep is nil; w.mu is held. A drain a reply already matched completes
// later.
func (w *Worker) cancelDrainsLocked(ep *Endpoint) {
	if len(w.drains) == 0 {
		return
	}
	for _, d := range w.drains {
		if ep == nil || d.ep == ep {
			raw.RequestCancel(w.h, d.req)
		}
	}
	w.reapDrainsLocked()
}

// progressLocked runs ucp_worker_progress once, releases the drains that
// completed and returns how many events it handled; w.mu is held.
func (w *Worker) progressLocked() uint32 {
	n := raw.WorkerProgress(w.h)
	if n > 0 && len(w.drains) > 0 {
		w.reapDrainsLocked()
	}
	return n
}

// ErrRefused matches the error of a Fetch the peer refused (the bytes are
// not inside an open Window of the token); the error quotes its reason.
var ErrRefused = errors.New("ucx: the peer refused the fetch")

// FetchStats count what a Context's served workers answered to fetch
// requests.
type FetchStats struct {
	// Sent counts replies of bytes handed to UCX, and SentBytes their
	// bytes.
	Sent, SentBytes uint64
	// Refused counts refusals: no open window of the token, or bytes
	// outside it.
	Refused uint64
	// Dropped counts requests left unanswered: malformed, or from a
	// reader this worker could not reach.
	Dropped uint64
	// Deferred counts requests that waited for bytes of a filling window
	// to be ready (counted again in Sent or Refused once answered).
	Deferred uint64
}

// fetchCounters are a Context's FetchStats.
type fetchCounters struct{ sent, sentBytes, refused, dropped, deferred atomic.Uint64 }

// FetchStats returns what the context's served workers answered so far.
func (c *Context) FetchStats() FetchStats {
	f := &c.fetched
	return FetchStats{Sent: f.sent.Load(), SentBytes: f.sentBytes.Load(), Refused: f.refused.Load(), Dropped: f.dropped.Load(),
		Deferred: f.deferred.Load()}
}

// fetchServer answers fetch requests on a served worker. Its fields are
// guarded by the worker's mu; it lives while Serve runs.
type fetchServer struct {
	w     *Worker
	recvs []*fetchSlot
	sends []*fetchSend
	peers map[fetchPeer]*Endpoint // endpoints back to readers
	pins  runtime.Pinner
	// deferred are requests for bytes of filling windows not ready yet,
	// answered when they are (Window.Ready wakes Serve).
	deferred []deferredFetch
	again    bool      // the last poll posted or handled something: look again
	swept    time.Time // when failed readers' endpoints were last swept
	log      *slog.Logger
}

// fetchSlot is a posted receive of requests.
type fetchSlot struct {
	buf []byte
	req raw.Request
}

// fetchSend is a reply under way: the bytes of region r (nil for a
// refusal, whose text msg holds) to ep.
type fetchSend struct {
	req raw.Request
	ep  *Endpoint
	r   *MemRegion
	msg []byte
	pin runtime.Pinner
}

func newFetchServer(w *Worker) *fetchServer {
	fs := &fetchServer{w: w, peers: map[fetchPeer]*Endpoint{}, log: slog.With("ucx", "fetch"), again: true}
	for range fetchRecvs {
		s := &fetchSlot{buf: make([]byte, MaxFetchRequest)}
		fs.pins.Pin(&s.buf[0])
		fs.recvs = append(fs.recvs, s)
	}
	return fs
}

// pollLocked posts the request receives, handles the requests that
// arrived and releases the replies that completed; w.mu is held. It
// returns how many it handled.
//
// Requests and replies complete inside ucp_worker_progress, or when a
// receive is posted for a request already waiting: unless progressed (the
// last progress handled events) or the last poll posted or handled
// something, it returns at once, so that a spinning Serve does not test
// every posted receive on every turn. Endpoints to readers that failed are
// swept after a reply failed, and once a second otherwise.
func (fs *fetchServer) pollLocked(progressed bool) int {
	retried := 0
	if len(fs.deferred) > 0 {
		retried = fs.retryDeferredLocked()
	}
	if !progressed && !fs.again && retried == 0 {
		return 0
	}
	w, handled, posted, failed := fs.w, retried, false, false
	param := raw.RequestParam{OpAttrMask: raw.OpAttrFlagNoImmCmpl}
	for _, s := range fs.recvs {
		if s.req != 0 {
			var info raw.TagRecvInfo
			st := raw.TagRecvRequestTest(s.req, &info)
			if st == raw.InProgress {
				continue
			}
			raw.RequestFree(s.req)
			s.req = 0
			handled++
			if st == raw.OK {
				fs.handleLocked(s.buf[:min(info.Length, uint64(len(s.buf)))])
			} else {
				fs.log.Debug("ucx: a fetch request was not received", "status", st)
			}
		}
		req, err := raw.TagRecvNbx(w.h, raw.Addr(s.buf), uint64(len(s.buf)), fetchRequestTag, ^uint64(0), &param)
		if err != nil {
			fs.log.Warn("ucx: cannot post a fetch request receive", "err", err)
			break
		}
		s.req, posted = req, true
	}
	kept := fs.sends[:0]
	for _, sd := range fs.sends {
		st := raw.RequestCheckStatus(sd.req)
		if st == raw.InProgress {
			kept = append(kept, sd)
			continue
		}
		handled++
		fs.finish(sd)
		if st != raw.OK {
			failed = true
			fs.log.Debug("ucx: a fetch reply failed", "status", st)
		}
	}
	fs.sends = kept
	fs.again = posted || handled > 0
	if !failed && time.Since(fs.swept) < time.Second {
		return handled
	}
	fs.swept = time.Now()
	for a, ep := range fs.peers {
		switch {
		case ep.closed:
			delete(fs.peers, a)
		case ep.failed.Load() != 0 && !fs.sending(ep):
			ep.shutLocked()
			delete(fs.peers, a)
		}
	}
	return handled
}

// finish releases a completed reply.
func (fs *fetchServer) finish(sd *fetchSend) {
	raw.RequestFree(sd.req)
	sd.pin.Unpin()
	if sd.r != nil {
		sd.r.sending.Add(-1)
	}
}

func (fs *fetchServer) sending(ep *Endpoint) bool {
	for _, sd := range fs.sends {
		if sd.ep == ep {
			return true
		}
	}
	return false
}

// handleLocked answers one request: the bytes, or a refusal; a request
// that cannot be answered (malformed, its reader unreachable) is dropped,
// and the reader's Fetch ends by its context.
func (fs *fetchServer) handleLocked(b []byte) {
	counts := &fs.w.ctx.fetched
	req, err := parseFetchRequest(b)
	if err != nil {
		counts.dropped.Add(1)
		fs.log.Warn("ucx: dropped a malformed fetch request", "err", err)
		return
	}
	r, wait, why := fs.w.ctx.windowFor(req.token, req.addr, req.n)
	// Endpoints are made to catch up with a reader's sequence number only
	// for requests the window answers: anyone who reaches the worker may
	// send requests, and a refusal needs but the one endpoint.
	sn := -1
	if r != nil || wait {
		sn = replySN(req.replyTag)
	}
	ep, err := fs.peerLocked(req.reader, sn)
	if err != nil {
		if r != nil {
			r.sending.Add(-1) // the reply windowFor counted
		}
		counts.dropped.Add(1)
		fs.log.Warn("ucx: cannot reach a fetching reader", "err", err)
		return
	}
	switch {
	case wait && len(fs.deferred) >= maxDeferred:
		counts.refused.Add(1)
		fs.refuseLocked(ep, req, fmt.Sprintf("%d fetches already wait for bytes not ready yet", len(fs.deferred)))
	case wait:
		counts.deferred.Add(1)
		fs.deferred = append(fs.deferred, deferredFetch{ep: ep, req: req, since: time.Now()})
	case r == nil:
		counts.refused.Add(1)
		fs.refuseLocked(ep, req, why)
	default:
		fs.sendLocked(ep, req, r)
	}
}

// deferredFetch is a request for bytes of a FillingWindow that were not
// ready when it came.
type deferredFetch struct {
	ep    *Endpoint
	req   fetchRequest
	since time.Time
}

// DeferWait bounds how long a fetch of bytes not ready yet (FillingWindow)
// waits at the holder: it is refused then.
const DeferWait = 30 * time.Second

// maxDeferred bounds the fetches a served worker keeps waiting for bytes
// not ready yet; more are refused at once.
const maxDeferred = 4096

// retryDeferredLocked answers the waiting fetches whose bytes are ready
// now (or whose window closed, or that waited DeferWait: refused) and
// returns how many it answered; w.mu is held.
func (fs *fetchServer) retryDeferredLocked() int {
	counts, answered := &fs.w.ctx.fetched, 0
	kept := fs.deferred[:0]
	for _, d := range fs.deferred {
		if d.ep.closed || d.ep.failed.Load() != 0 {
			counts.dropped.Add(1)
			answered++
			continue
		}
		r, wait, why := fs.w.ctx.windowFor(d.req.token, d.req.addr, d.req.n)
		switch {
		case wait && time.Since(d.since) < DeferWait:
			kept = append(kept, d)
			continue
		case wait:
			counts.refused.Add(1)
			fs.refuseLocked(d.ep, d.req, fmt.Sprintf("the bytes were not ready within %v", DeferWait))
		case r == nil:
			counts.refused.Add(1)
			fs.refuseLocked(d.ep, d.req, why)
		default:
			fs.sendLocked(d.ep, d.req, r)
		}
		answered++
	}
	clear(fs.deferred[len(kept):])
	fs.deferred = kept
	return answered
}

// sendLocked sends the reader the bytes it asked for, from region r (a
// reply counted on r by windowFor).
func (fs *fetchServer) sendLocked(ep *Endpoint, req fetchRequest, r *MemRegion) {
	counts := &fs.w.ctx.fetched
	counts.sent.Add(1)
	counts.sentBytes.Add(req.n)
	p := raw.RequestParam{OpAttrMask: raw.OpAttrFieldMemh | raw.OpAttrFieldMemoryType, Memh: r.h, MemoryType: r.memType}
	sreq, err := raw.TagSendNbx(ep.h, req.addr, req.n, req.replyTag, &p)
	switch {
	case err != nil:
		r.sending.Add(-1)
		fs.log.Debug("ucx: a fetch reply failed", "err", err)
	case sreq == 0:
		r.sending.Add(-1)
	default:
		fs.sends = append(fs.sends, &fetchSend{req: sreq, ep: ep, r: r})
	}
}

// refuseLocked sends the reader a refusal in place of the bytes.
func (fs *fetchServer) refuseLocked(ep *Endpoint, req fetchRequest, why string) {
	msg := []byte("holder: " + why)
	msg = msg[:min(uint64(len(msg)), req.n, maxRefusal)]
	sd := &fetchSend{ep: ep, msg: msg}
	sd.pin.Pin(&msg[0])
	sreq, err := raw.TagSendNbx(ep.h, raw.Addr(msg), uint64(len(msg)), req.replyTag|fetchReplyErr, &raw.RequestParam{})
	if err != nil || sreq == 0 {
		sd.pin.Unpin()
		return
	}
	sd.req = sreq
	fs.sends = append(fs.sends, sd)
}

// replyTag is the reply tag of a Fetch's seq-th request, sent on an
// endpoint of connection sequence number sn (-1: none).
func replyTag(seq uint64, sn int) uint64 {
	t := fetchReplyBase | seq&fetchReplyCount
	if sn >= 0 {
		t |= fetchReplyHasSN | uint64(sn)<<fetchReplySNShift
	}
	return t
}

// replySN is the connection sequence number a reply tag carries, or -1.
func replySN(tag uint64) int {
	if tag&fetchReplyHasSN == 0 {
		return -1
	}
	return int(tag & fetchReplySN >> fetchReplySNShift)
}

// fetchPeer names an endpoint of a serving worker back to a reader: the
// reader's address, and the connection sequence number it pairs with
// (-1: the one endpoint for readers whose requests carry none).
type fetchPeer struct {
	addr string
	sn   int
}

// maxCatchUp bounds the endpoints peerLocked creates for one request to
// reach the reader's connection sequence number.
const maxCatchUp = 64

// peerLocked returns the endpoint to reply to a reader on, whose request
// came on its endpoint of connection sequence number sn (-1: unknown).
//
// UCX sends a reply to the reader's endpoint that it paired the holder's
// with (nextSNLocked says how), and the reader's worker cancels every
// rendezvous reply arriving for one it closed forcibly (UCS_ERR_CANCELED,
// for as long as the holder keeps its endpoint: it is told nothing). So
// the reply goes on the holder's endpoint of the same number as the one
// the request came on, which is open since it just sent it: the one made
// for it before, or one made now, after those of the numbers between
// (which pair with the reader's endpoints of theirs). Where that number is
// past (this worker's own endpoint took it, or it was closed) or too far
// ahead, or the request has none, the reply goes on one endpoint kept for
// the reader, as for a reader that sends none.
func (fs *fetchServer) peerLocked(a WorkerAddress, sn int) (*Endpoint, error) {
	key := fetchPeer{string(a.b), sn}
	if ep, ok := fs.peers[key]; ok && !ep.closed && ep.failed.Load() == 0 {
		return ep, nil
	}
	next := fs.w.sns[string(a.b)]
	if sn < next || sn-next >= maxCatchUp {
		key.sn = -1
		if ep, ok := fs.peers[key]; ok && !ep.closed && ep.failed.Load() == 0 {
			return ep, nil
		}
	}
	for {
		if len(fs.peers) >= maxFetchPeers {
			for k, ep := range fs.peers {
				if !fs.sending(ep) {
					if !ep.closed {
						ep.shutLocked()
					}
					delete(fs.peers, k)
					break
				}
			}
			if len(fs.peers) >= maxFetchPeers {
				return nil, fmt.Errorf("ucx: %d endpoints to readers have replies under way", len(fs.peers))
			}
		}
		ep, err := fs.w.connectLocked(a)
		if err != nil {
			return nil, err
		}
		if key.sn < 0 || ep.sn < 0 || ep.sn >= key.sn {
			// The one wanted; or (UCX's count saturated) the last.
			fs.peers[key] = ep
			return ep, nil
		}
		// A number on the way: the reader's endpoint of it may be open.
		fs.peers[fetchPeer{key.addr, ep.sn}] = ep
	}
}

// stopLocked ends the server when Serve returns: it cancels the request
// receives and waits, progressing the worker, for the replies under way,
// up to closeWait before it closes their endpoints forcibly and purgeWait
// after; w.mu is held.
func (fs *fetchServer) stopLocked() {
	w := fs.w
	fs.deferred = nil // never answered: their readers' fetches end by their contexts
	for _, s := range fs.recvs {
		if s.req != 0 {
			raw.RequestCancel(w.h, s.req)
		}
	}
	start := time.Now()
	forced := false
	for {
		raw.WorkerProgress(w.h)
		for _, s := range fs.recvs {
			if s.req != 0 && raw.RequestCheckStatus(s.req) != raw.InProgress {
				raw.RequestFree(s.req)
				s.req = 0
			}
		}
		kept := fs.sends[:0]
		for _, sd := range fs.sends {
			if raw.RequestCheckStatus(sd.req) != raw.InProgress {
				fs.finish(sd)
				continue
			}
			kept = append(kept, sd)
		}
		fs.sends = kept
		pending := len(fs.sends)
		for _, s := range fs.recvs {
			if s.req != 0 {
				pending++
			}
		}
		if pending == 0 {
			break
		}
		if !forced && time.Since(start) > closeWait {
			for _, ep := range fs.peers {
				if !ep.closed {
					ep.shutLocked()
				}
			}
			forced = true
		}
		if time.Since(start) > closeWait+purgeWait {
			fs.log.Warn("ucx: fetch replies did not complete after their endpoints were closed", "replies", len(fs.sends))
			for _, sd := range fs.sends {
				fs.finish(sd)
			}
			for _, s := range fs.recvs {
				if s.req != 0 {
					raw.RequestFree(s.req)
				}
			}
			break
		}
	}
	for _, ep := range fs.peers {
		if !ep.closed {
			ep.shutLocked()
		}
	}
	fs.peers = nil
	fs.sends = nil
	fs.pins.Unpin()
}

// shutSendsOf closes forcibly the endpoints of replies from region r, so
// that UCX completes them (canceled) on the next progress; w.mu is held.
func (fs *fetchServer) shutSendsOf(r *MemRegion) {
	for _, sd := range fs.sends {
		if sd.r == r && !sd.ep.closed {
			sd.ep.shutLocked()
		}
	}
}
