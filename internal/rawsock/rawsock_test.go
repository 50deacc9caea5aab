package rawsock

import (
	"bytes"
	"crypto/rand"
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// socketpair returns a connected pair of non-blocking SEQPACKET sockets;
// closeA closes the first early (the test's end closes the rest).
func socketpair(t *testing.T) (a, b int, closeA func()) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	aOpen := true
	closeA = func() {
		if aOpen {
			aOpen = false
			unix.Close(fds[0])
		}
	}
	t.Cleanup(func() { closeA(); unix.Close(fds[1]) })
	return fds[0], fds[1], closeA
}

// A packet with a descriptor attached arrives whole, with the descriptor;
// an empty socket says EAGAIN; a packet larger than the buffer is cut and
// flagged; a closed peer reads as an empty packet and writes as EPIPE.
func TestSendRecv(t *testing.T) {
	a, b, closeA := socketpair(t)
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4*4))
	if _, _, _, err := Recvmsg(b, buf, oob, 0); !errors.Is(err, unix.EAGAIN) {
		t.Fatalf("recv on an empty socket: %v, want EAGAIN", err)
	}

	msg := make([]byte, 1000)
	rand.Read(msg)
	f, err := os.CreateTemp(t.TempDir(), "fd")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if n, err := Sendmsg(a, msg, unix.UnixRights(int(f.Fd())), unix.MSG_NOSIGNAL); err != nil || n != len(msg) {
		t.Fatalf("send: %d, %v", n, err)
	}
	n, oobn, flags, err := Recvmsg(b, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil || n != len(msg) || !bytes.Equal(buf[:n], msg) || flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		t.Fatalf("recv: %d bytes (equal %v), flags %#x, %v", n, bytes.Equal(buf[:n], msg), flags, err)
	}
	cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(cmsgs) != 1 {
		t.Fatalf("control messages: %v, %v", cmsgs, err)
	}
	fds, err := unix.ParseUnixRights(&cmsgs[0])
	if err != nil || len(fds) != 1 {
		t.Fatalf("rights: %v, %v", fds, err)
	}
	var st1, st2 unix.Stat_t
	unix.Fstat(fds[0], &st1)
	unix.Fstat(int(f.Fd()), &st2)
	unix.Close(fds[0])
	if st1.Ino != st2.Ino {
		t.Error("the descriptor received is not the file sent")
	}

	big := make([]byte, 2*len(buf))
	rand.Read(big)
	if _, err := Sendmsg(a, big, nil, unix.MSG_NOSIGNAL); err != nil {
		t.Fatal(err)
	}
	if n, _, flags, err := Recvmsg(b, buf, nil, 0); err != nil || n != len(buf) || flags&unix.MSG_TRUNC == 0 || !bytes.Equal(buf, big[:len(buf)]) {
		t.Fatalf("oversized packet: %d bytes, flags %#x, %v", n, flags, err)
	}

	closeA()
	if n, _, _, err := Recvmsg(b, buf, oob, 0); err != nil || n != 0 {
		t.Fatalf("recv after the peer closed: %d, %v; want 0 bytes", n, err)
	}
	if _, err := Sendmsg(b, msg, nil, unix.MSG_NOSIGNAL); !errors.Is(err, unix.EPIPE) {
		t.Fatalf("send to a closed peer: %v, want EPIPE", err)
	}
}
