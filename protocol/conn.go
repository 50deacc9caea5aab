package protocol

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/cudaipc/cudaipc/internal/rawsock"
)

const (
	// Version is the protocol version this package speaks. Version 2
	// states each placement's kind and gives every GPU placement a region;
	// a version 1 client would take a vmm-fd placement for a legacy one.
	Version = 2
	// MaxMessageSize is the largest packet, in bytes, either side may send.
	MaxMessageSize = 64 << 10
	// MaxFiles is the most file descriptors one packet may carry
	// (SCM_RIGHTS allows 253): a register request, a stage_files request,
	// a get of registered memory and a files answer carry up to this many
	// of a registration's descriptors.
	MaxFiles = 60
	// MaxPieces is the most pieces (physical allocations, one descriptor
	// each) one registered object may span: cudaipc.MaxRegionPieces. The
	// descriptors beyond a packet's MaxFiles travel in stage_files requests
	// and files answers; the daemon's descriptor limits per uid and in all
	// bound what one user may have it keep.
	MaxPieces = 1 << 16
	// MaxSpaceSize is the largest KV space description a registration may
	// carry (RegisterRequest.space): it travels in every info of the
	// object, which must fit in a packet beside the rest.
	MaxSpaceSize = 16 << 10
)

// maxSpinSkip bounds the receives that skip polling after windows that
// found nothing (RecvSpin).
const maxSpinSkip = 64

// oobSize leaves room for more descriptors than MaxFiles so that a peer
// sending too many is detected, and the excess closed, rather than having
// the kernel drop them silently behind MSG_CTRUNC.
var oobSize = unix.CmsgSpace(4 * 4 * MaxFiles)

// Conn is one end of a store connection: a Unix SOCK_SEQPACKET socket on
// which every packet is one protobuf message, optionally with file
// descriptors attached as SCM_RIGHTS.
//
// Send and Recv may be called from different goroutines at the same time;
// concurrent Sends (or Recvs) are serialized.
type Conn struct {
	uc *net.UnixConn
	rc syscall.RawConn // uc's descriptor, for sendmsg and recvmsg (rawsock)

	sendMu  sync.Mutex
	sendBuf []byte

	recvMu sync.Mutex
	buf    []byte // MaxMessageSize+1: a packet that fills it is too large
	oob    []byte
	// spinSkip receives poll no more after a window that found nothing;
	// spinBackoff is the next such count (RecvSpin).
	spinSkip, spinBackoff int

	// rdeadline is the read deadline (Unix nanoseconds; 0: none), set by
	// SetReadDeadline, so that a receive spinning (RecvSpin) stops at it.
	rdeadline atomic.Int64
}

// NewConn returns a Conn using c, which must be a connected Unix socket of
// type SOCK_SEQPACKET ("unixpacket"). The Conn owns c from now on.
func NewConn(c *net.UnixConn) *Conn {
	rc, _ := c.SyscallConn() // fails only for a closed c: then so does every call
	return &Conn{
		uc:  c,
		rc:  rc,
		buf: make([]byte, MaxMessageSize+1),
		oob: make([]byte, oobSize),
	}
}

// Dial connects to the store socket at path. It does not perform the
// handshake; see ClientHello.
//
// A full listen backlog (a flood of connections the daemon is still
// refusing) makes a non-blocking connect fail with EAGAIN where a blocking
// one would wait: Dial waits too, retrying until ctx ends.
func Dial(ctx context.Context, path string) (*Conn, error) {
	var d net.Dialer
	var c net.Conn
	var err error
	for wait := 100 * time.Microsecond; ; wait = min(2*wait, 20*time.Millisecond) {
		c, err = d.DialContext(ctx, "unixpacket", path)
		if !errors.Is(err, syscall.EAGAIN) {
			break
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(wait):
		}
	}
	if err != nil {
		return nil, err
	}
	return NewConn(c.(*net.UnixConn)), nil
}

// Send writes m as one packet, with files attached as SCM_RIGHTS. The files
// are duplicated into the peer by the kernel; the caller still owns (and
// eventually closes) its copies. Errors: a *MessageError (ErrTooLarge,
// ErrTooManyFiles, ErrMalformed) when the message cannot be sent, one
// matching io.EOF when the peer has gone, or the system error.
func (c *Conn) Send(m proto.Message, files ...*os.File) error {
	if len(files) > MaxFiles {
		return &MessageError{Op: "send", Err: ErrTooManyFiles,
			Detail: fmt.Sprintf("%d files, at most %d", len(files), MaxFiles)}
	}
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	b, err := proto.MarshalOptions{}.MarshalAppend(c.sendBuf[:0], m)
	if err != nil {
		return &MessageError{Op: "send", Err: ErrMalformed, Cause: err}
	}
	if cap(b) <= 2*MaxMessageSize {
		c.sendBuf = b
	}
	if len(b) > MaxMessageSize {
		return &MessageError{Op: "send", Err: ErrTooLarge,
			Detail: fmt.Sprintf("%d bytes, at most %d", len(b), MaxMessageSize)}
	}
	if len(b) == 0 {
		// The receiver could not tell an empty packet from the end of the
		// stream; no valid Request or Response encodes to nothing.
		return &MessageError{Op: "send", Err: ErrMalformed, Detail: "empty message"}
	}
	for i, f := range files {
		if f == nil {
			return &MessageError{Op: "send", Err: ErrMalformed, Detail: fmt.Sprintf("file %d is nil", i)}
		}
	}
	return withFds(files, nil, func(fds []int) error {
		var oob []byte
		if len(fds) > 0 {
			oob = unix.UnixRights(fds...)
		}
		n, err := c.sendmsg(b, oob)
		if err != nil {
			return peerGone(err)
		}
		if n != len(b) {
			return fmt.Errorf("protocol: send: short write of %d of %d bytes", n, len(b))
		}
		return nil
	})
}

// withFds calls fn with the descriptors of files, holding each file's
// SyscallConn so none can be closed meanwhile. File.Fd would instead switch
// pollable files (pipes) to blocking mode.
func withFds(files []*os.File, fds []int, fn func([]int) error) error {
	if len(files) == 0 {
		return fn(fds)
	}
	rc, err := files[0].SyscallConn()
	if err != nil {
		return fmt.Errorf("protocol: send: %w", err)
	}
	var inner error
	if err := rc.Control(func(fd uintptr) {
		inner = withFds(files[1:], append(fds, int(fd)), fn)
	}); err != nil {
		return fmt.Errorf("protocol: send: file %s: %w", files[0].Name(), err)
	}
	return inner
}

// Recv reads one packet, decodes it into m and returns the files attached to
// it, which the caller owns and must close. On any error no files are
// returned: those received are closed. Errors: io.EOF (or an error matching
// it) when the peer has closed the connection; a *MessageError (ErrTooLarge,
// ErrMalformed, ErrTooManyFiles) for a packet that breaks the protocol,
// after which the connection should be closed; or the system error.
func (c *Conn) Recv(m proto.Message) ([]*os.File, error) {
	return c.RecvSpin(m, 0)
}

// RecvSpin is Recv that, when no packet has arrived yet, keeps polling the
// socket for up to spin before waiting in the netpoller: a reply that comes
// within the window is read without the park and wake-up of the goroutine
// (epoll and the scheduler), which is most of the cost of a round trip
// between processes. The polling costs a CPU for at most spin per call, and
// stops at once at a read deadline (SetReadDeadline; one in the past
// interrupts it like a waiting Recv). spin <= 0 is Recv.
//
// A window that ends with nothing received makes the next receives skip
// polling, 1, then 2, 4, … up to maxSpinSkip of them after each further
// such window, until one finds a packet while polling: when the peer is
// slow, or both processes share a busy core (polling then holds up the very
// reply it waits for), polling costs little.
func (c *Conn) RecvSpin(m proto.Message, spin time.Duration) ([]*os.File, error) {
	c.recvMu.Lock()
	defer c.recvMu.Unlock()
	if spin > 0 && c.spinSkip > 0 {
		c.spinSkip--
		spin = 0
	}
	n, oobn, flags, rerr := c.recvmsg(spin)
	var files []*os.File
	var ferr error
	if oobn > 0 {
		// Collect descriptors even when the read failed: a peer may attach
		// them to an empty (end-of-stream-looking) or oversized packet.
		files, ferr = parseRights(c.oob[:oobn])
	}
	fail := func(err error) ([]*os.File, error) {
		CloseFiles(files)
		return nil, err
	}
	switch {
	case rerr != nil:
		return fail(peerGone(rerr))
	case ferr != nil:
		return fail(ferr)
	case flags&unix.MSG_TRUNC != 0 || n > MaxMessageSize:
		return fail(&MessageError{Op: "recv", Err: ErrTooLarge,
			Detail: fmt.Sprintf("packet exceeds %d bytes", MaxMessageSize)})
	case flags&unix.MSG_CTRUNC != 0 || len(files) > MaxFiles:
		return fail(&MessageError{Op: "recv", Err: ErrTooManyFiles,
			Detail: fmt.Sprintf("more than %d files on one packet", MaxFiles)})
	}
	if err := proto.Unmarshal(c.buf[:n], m); err != nil {
		return fail(&MessageError{Op: "recv", Err: ErrMalformed, Cause: err})
	}
	return files, nil
}

// recvmsg reads one packet into c.buf and its control messages into c.oob,
// waiting in the netpoller while there is none (and for the read deadline),
// like net.UnixConn.ReadMsgUnix, whose errors it reproduces: an empty
// packet is io.EOF; failures are *net.OpError. The receive itself is a
// raw system call (package rawsock says why).
func (c *Conn) recvmsg(spin time.Duration) (n, oobn, flags int, err error) {
	if c.rc == nil {
		n, oobn, flags, _, err = c.uc.ReadMsgUnix(c.buf, c.oob)
		return
	}
	var serr error
	err = c.rc.Read(func(fd uintptr) bool {
		n, oobn, flags, serr = rawsock.Recvmsg(int(fd), c.buf, c.oob, unix.MSG_CMSG_CLOEXEC)
		if serr != unix.EAGAIN {
			return true
		}
		if spin <= 0 {
			return false
		}
		// Poll for at most spin, once per call: returning false parks in
		// the netpoller, which also reports a deadline that has passed.
		end := time.Now().Add(spin).UnixNano()
		spin = 0
		for {
			now := time.Now().UnixNano()
			if d := c.rdeadline.Load(); now >= end || d != 0 && now >= d {
				c.spinBackoff = min(max(2*c.spinBackoff, 1), maxSpinSkip)
				c.spinSkip = c.spinBackoff
				return false
			}
			runtime.Gosched() // let this P's other goroutines run meanwhile
			n, oobn, flags, serr = rawsock.Recvmsg(int(fd), c.buf, c.oob, unix.MSG_CMSG_CLOEXEC)
			if serr != unix.EAGAIN {
				c.spinBackoff = 0
				return true
			}
		}
	})
	switch {
	case err == nil && serr != nil:
		err = os.NewSyscallError("recvmsg", serr)
	case err == nil && n == 0:
		return 0, oobn, flags, io.EOF
	}
	if err != nil {
		return 0, 0, 0, &net.OpError{Op: "read", Net: "unixpacket", Source: c.uc.LocalAddr(), Addr: c.uc.RemoteAddr(), Err: err}
	}
	return n, oobn, flags, nil
}

// sendmsg sends b as one packet with the control messages oob, waiting in
// the netpoller while the socket is full (and for the write deadline), like
// net.UnixConn.WriteMsgUnix, whose errors it reproduces. A peer that has
// gone is EPIPE, never SIGPIPE (MSG_NOSIGNAL).
func (c *Conn) sendmsg(b, oob []byte) (int, error) {
	if c.rc == nil {
		n, _, err := c.uc.WriteMsgUnix(b, oob, nil)
		return n, err
	}
	var n int
	var serr error
	err := c.rc.Write(func(fd uintptr) bool {
		n, serr = rawsock.Sendmsg(int(fd), b, oob, unix.MSG_NOSIGNAL)
		return serr != unix.EAGAIN
	})
	if err == nil && serr != nil {
		err = os.NewSyscallError("sendmsg", serr)
	}
	if err != nil {
		return 0, &net.OpError{Op: "write", Net: "unixpacket", Source: c.uc.LocalAddr(), Addr: c.uc.RemoteAddr(), Err: err}
	}
	return n, nil
}

// parseRights returns the descriptors in the SCM_RIGHTS messages of oob as
// files. Other control messages are ignored; on error the descriptors found
// so far are returned for closing.
func parseRights(oob []byte) ([]*os.File, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, &MessageError{Op: "recv", Err: ErrMalformed, Detail: "control message", Cause: err}
	}
	var files []*os.File
	for _, msg := range msgs {
		if msg.Header.Level != unix.SOL_SOCKET || msg.Header.Type != unix.SCM_RIGHTS {
			continue
		}
		fds, err := unix.ParseUnixRights(&msg)
		if err != nil {
			return files, &MessageError{Op: "recv", Err: ErrMalformed, Detail: "SCM_RIGHTS", Cause: err}
		}
		for _, fd := range fds {
			files = append(files, os.NewFile(uintptr(fd), fmt.Sprintf("scm-rights-fd-%d", fd)))
		}
	}
	return files, nil
}

// peerGone turns the errors that mean "the other end has closed" into ones
// matching io.EOF, so callers test a single condition.
func peerGone(err error) error {
	if errors.Is(err, io.EOF) {
		return io.EOF
	}
	if errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return fmt.Errorf("protocol: peer closed the connection: %w (%w)", io.EOF, err)
	}
	return err
}

// CloseFiles closes every non-nil file in files, ignoring errors. It is for
// received files that will not be used.
func CloseFiles(files []*os.File) {
	for _, f := range files {
		if f != nil {
			f.Close()
		}
	}
}

// PeerCred returns the credentials (pid, uid, gid) of the peer process as of
// the time the connection was made (SO_PEERCRED).
func (c *Conn) PeerCred() (*unix.Ucred, error) {
	rc, err := c.uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	if cerr != nil {
		return nil, fmt.Errorf("protocol: SO_PEERCRED: %w", cerr)
	}
	return cred, nil
}

// SetReadDeadline sets the time after which a Recv waiting for a packet
// (now or later) fails with an error matching os.ErrDeadlineExceeded,
// having consumed nothing; the zero time means no deadline.
func (c *Conn) SetReadDeadline(t time.Time) error {
	var d int64
	if !t.IsZero() {
		d = max(t.UnixNano(), 1)
	}
	c.rdeadline.Store(d)
	return c.uc.SetReadDeadline(t)
}

// CloseWrite shuts down the sending side: the peer's Recv returns io.EOF
// once it has read every packet sent before, while this side can still
// receive.
func (c *Conn) CloseWrite() error { return c.uc.CloseWrite() }

// Close closes the connection; a Recv blocked in another goroutine returns
// an error matching net.ErrClosed.
func (c *Conn) Close() error { return c.uc.Close() }
