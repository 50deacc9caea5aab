// Package rawsock is the raw layer under the store's sockets: sendmsg and
// recvmsg on a non-blocking socket without the scheduler's system-call
// bookkeeping.
//
// syscall.Syscall (what net and x/sys/unix use) tells the Go scheduler that
// the thread may block: entersyscall, and, when the process has been idle,
// a wake-up of the runtime's monitor thread (a futex call) before the
// system call itself; exitsyscall after. On a non-blocking socket the call
// never blocks (EAGAIN instead), so a raw system call is correct and skips
// that work on every packet, a measurable part of a store round trip
// (docs/lab/bench-store.md, "Store round trip").
//
// It is, with internal/cu and internal/shm, the only package with unsafe:
// the message header the kernel reads holds pointers to Go memory. Callers
// must pass descriptors of non-blocking sockets only (every socket of
// package net is), from inside syscall.RawConn's Read or Write, which
// waits for readiness on EAGAIN.
package rawsock

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Recvmsg receives one packet on the non-blocking socket fd into p, its
// control messages into oob, as recvmsg(2) with flags: it returns the
// packet's length, the control messages' length and the message flags
// (MSG_TRUNC, MSG_CTRUNC). A packet that would block is unix.EAGAIN. p must
// not be empty.
func Recvmsg(fd int, p, oob []byte, flags int) (n, oobn, recvflags int, err error) {
	return msgcall(unix.SYS_RECVMSG, fd, p, oob, flags)
}

// Sendmsg sends p as one packet on the non-blocking socket fd, with the
// control messages oob, as sendmsg(2) with flags, and returns the bytes
// sent. A packet that would block is unix.EAGAIN. p must not be empty.
func Sendmsg(fd int, p, oob []byte, flags int) (int, error) {
	r, _, _, err := msgcall(unix.SYS_SENDMSG, fd, p, oob, flags)
	return r, err
}

// msgcall makes the recvmsg or sendmsg system call trap over one buffer p and
// the control buffer oob, retrying on EINTR, and returns its result and the
// control length and flags the kernel left in the message header (the header
// stays on the stack: no allocation per packet).
func msgcall(trap uintptr, fd int, p, oob []byte, flags int) (n, oobn, msgflags int, err error) {
	var iov unix.Iovec
	iov.Base = &p[0]
	iov.SetLen(len(p))
	var msg unix.Msghdr
	msg.Iov = &iov
	msg.Iovlen = 1
	if len(oob) > 0 {
		msg.Control = &oob[0]
		msg.SetControllen(len(oob))
	}
	for {
		r, _, e := syscall.RawSyscall(trap, uintptr(fd), uintptr(unsafe.Pointer(&msg)), uintptr(flags))
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return 0, 0, 0, e
		}
		return int(r), int(msg.Controllen), int(msg.Flags), nil
	}
}
