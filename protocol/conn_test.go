package protocol

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/protocol/storev1"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// helperEnv names the role a re-executed test binary plays.
const helperEnv = "CUDAIPC_PROTOCOL_TEST_HELPER"

func TestMain(m *testing.M) {
	switch role := os.Getenv(helperEnv); role {
	case "":
		os.Exit(m.Run())
	case "copy-memfd":
		if err := helperCopyMemfd(); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	default:
		fmt.Fprintf(os.Stderr, "unknown helper role %q\n", role)
		os.Exit(2)
	}
}

// socketpair returns two connected SOCK_SEQPACKET sockets, as raw fds
// wrapped in files so tests can also write raw packets to them.
func socketpair(t testing.TB) (a, b *os.File) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, b = os.NewFile(uintptr(fds[0]), "sock-a"), os.NewFile(uintptr(fds[1]), "sock-b")
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// newConn wraps a duplicate of the socket f in a Conn.
func newConn(t testing.TB, f *os.File) *Conn {
	t.Helper()
	nc, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	c := NewConn(nc.(*net.UnixConn))
	t.Cleanup(func() { c.Close() })
	return c
}

// connPair returns two connected Conns.
func connPair(t testing.TB) (*Conn, *Conn) {
	a, b := socketpair(t)
	ca, cb := newConn(t, a), newConn(t, b)
	a.Close()
	b.Close()
	return ca, cb
}

func randomBytes(t testing.TB, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// memfdWith returns a memfd holding data.
func memfdWith(t testing.TB, data []byte) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("protocol-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "memfd")
	t.Cleanup(func() { f.Close() })
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	return f
}

// leakProbe is a pipe whose write end is sent to the code under test: once
// every copy of the write end is closed, reading the read end reports EOF
// instead of EAGAIN. That proves a received descriptor was closed.
type leakProbe struct{ r, w *os.File }

func newLeakProbe(t testing.TB) *leakProbe {
	t.Helper()
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		t.Fatal(err)
	}
	lp := &leakProbe{r: os.NewFile(uintptr(p[0]), "probe-r"), w: os.NewFile(uintptr(p[1]), "probe-w")}
	t.Cleanup(func() { lp.r.Close(); lp.w.Close() })
	return lp
}

// closedEverywhere closes our write end and reports whether no other copy
// remains open.
func (lp *leakProbe) closedEverywhere(t testing.TB) bool {
	t.Helper()
	lp.w.Close()
	rc, err := lp.r.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var n int
	var rerr error
	rc.Control(func(fd uintptr) { n, rerr = unix.Read(int(fd), make([]byte, 1)) })
	if rerr == unix.EAGAIN {
		return false
	}
	if rerr != nil || n != 0 {
		t.Fatalf("reading probe: n=%d err=%v", n, rerr)
	}
	return true
}

// sendRaw writes one packet with the given descriptors straight to the socket.
func sendRaw(t testing.TB, sock *os.File, data []byte, fds ...int) {
	t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if err := unix.Sendmsg(int(sock.Fd()), data, oob, nil, 0); err != nil {
		t.Fatalf("sendmsg of %d bytes, %d fds: %v", len(data), len(fds), err)
	}
}

func mustMarshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func createRequest(id uint64, name string, size uint64) *storev1.Request {
	return &storev1.Request{Id: id, Body: &storev1.Request_Create{Create: &storev1.CreateRequest{
		Name: name, Size: size, Device: "host", Shared: true}}}
}

func TestSendRecvRoundTrip(t *testing.T) {
	client, server := connPair(t)
	req := createRequest(7, "tensor-0", 12345)
	if err := client.Send(req); err != nil {
		t.Fatal(err)
	}
	var got storev1.Request
	files, err := server.Recv(&got)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 0 || !proto.Equal(&got, req) {
		t.Fatalf("got %v with %d files, want %v", &got, len(files), req)
	}
	if err := ValidateRequest(&got, len(files)); err != nil {
		t.Fatal(err)
	}
}

func TestFilesCrossTheSocket(t *testing.T) {
	client, server := connPair(t)
	memData := randomBytes(t, 1<<20+13)
	pipeData := randomBytes(t, 4096)
	mem := memfdWith(t, memData)
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	defer pw.Close()

	resp := &storev1.Response{Id: 3, Body: &storev1.Response_Create{Create: &storev1.CreateResponse{
		Placement: &storev1.Placement{Kind: storev1.Placement_HOST, ArenaId: 1, Device: "host", Offset: 0, Size: uint64(len(memData)),
			ArenaSize: uint64(len(memData)), Writable: true, FdAttached: true}}}}
	if err := server.Send(resp, mem, pr); err != nil {
		t.Fatal(err)
	}
	pr.Close() // the receiver holds its own copy now

	var got storev1.Response
	files, err := client.Recv(&got)
	if err != nil {
		t.Fatal(err)
	}
	defer CloseFiles(files)
	if len(files) != 2 {
		t.Fatalf("received %d files, want 2", len(files))
	}
	if !proto.Equal(&got, resp) {
		t.Fatalf("got %v, want %v", &got, resp)
	}
	for _, f := range files {
		flags, err := unix.FcntlInt(f.Fd(), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC == 0 {
			t.Errorf("received fd %s lacks FD_CLOEXEC (flags %#x, err %v)", f.Name(), flags, err)
		}
	}

	// The memfd is the same file: its bytes, and writes through either
	// descriptor are visible through the other.
	back := make([]byte, len(memData))
	if _, err := files[0].ReadAt(back, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, memData) {
		t.Fatal("memfd read through the received descriptor differs")
	}
	patch := randomBytes(t, 64)
	if _, err := files[0].WriteAt(patch, 100); err != nil {
		t.Fatal(err)
	}
	if _, err := mem.ReadAt(back[:64], 100); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back[:64], patch) {
		t.Fatal("write through the received memfd is not visible to the sender")
	}

	// The pipe's read end: bytes written by the sender arrive.
	go func() {
		pw.Write(pipeData)
		pw.Close()
	}()
	piped, err := io.ReadAll(files[1])
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(piped, pipeData) {
		t.Fatal("pipe read through the received descriptor differs")
	}
}

// TestFilesCrossProcesses passes a memfd to a child process, which copies
// its contents into a memfd of its own and sends that back.
func TestFilesCrossProcesses(t *testing.T) {
	parentSock, childSock := socketpair(t)
	conn := newConn(t, parentSock)
	parentSock.Close()

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=copy-memfd")
	cmd.ExtraFiles = []*os.File{childSock} // fd 3 in the child
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	childSock.Close()

	data := randomBytes(t, 3<<20+7)
	mem := memfdWith(t, data)
	req := createRequest(1, "cross-process", uint64(len(data)))
	if err := conn.Send(req, mem); err != nil {
		t.Fatal(err)
	}
	var resp storev1.Response
	files, err := conn.Recv(&resp)
	if err != nil {
		t.Fatal(err)
	}
	defer CloseFiles(files)
	if err := ValidateResponse(&resp, len(files)); err != nil {
		t.Fatal(err)
	}
	if len(files) != 1 {
		t.Fatalf("got %d files", len(files))
	}
	p := resp.GetCreate().GetPlacement()
	back := make([]byte, p.GetSize())
	if _, err := files[0].ReadAt(back, int64(p.GetOffset())); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, data) {
		t.Fatal("the child's copy differs")
	}
	// The child exits once we are gone.
	conn.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
}

func helperCopyMemfd() error {
	nc, err := net.FileConn(os.NewFile(3, "sock"))
	if err != nil {
		return err
	}
	c := NewConn(nc.(*net.UnixConn))
	defer c.Close()
	var req storev1.Request
	files, err := c.Recv(&req)
	if err != nil {
		return err
	}
	defer CloseFiles(files)
	if len(files) != 1 {
		return fmt.Errorf("got %d files", len(files))
	}
	size := req.GetCreate().GetSize()
	// Map the received memfd as a client would map an arena.
	m, err := unix.Mmap(int(files[0].Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	defer unix.Munmap(m)
	const offset = 4096
	fd, err := unix.MemfdCreate("child", unix.MFD_CLOEXEC)
	if err != nil {
		return err
	}
	out := os.NewFile(uintptr(fd), "child-memfd")
	defer out.Close()
	if _, err := out.WriteAt(m, offset); err != nil {
		return err
	}
	resp := &storev1.Response{Id: req.GetId(), Body: &storev1.Response_Create{Create: &storev1.CreateResponse{
		Placement: &storev1.Placement{Kind: storev1.Placement_HOST, ArenaId: 9, Device: "host", Offset: offset, Size: size,
			ArenaSize: offset + size, Writable: true, FdAttached: true}}}}
	if err := c.Send(resp, out); err != nil {
		return err
	}
	var none storev1.Request
	if _, err := c.Recv(&none); !errors.Is(err, io.EOF) {
		return fmt.Errorf("waiting for the parent to close: %v", err)
	}
	return nil
}

func TestOversizedPacket(t *testing.T) {
	for _, size := range []int{MaxMessageSize + 1, 3 * MaxMessageSize} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			raw, sock := socketpair(t)
			c := newConn(t, sock)
			probe := newLeakProbe(t)
			sendRaw(t, raw, randomBytes(t, size), int(probe.w.Fd()))
			// A valid packet follows: the oversized one must not break framing.
			next := createRequest(2, "after", 1)
			sendRaw(t, raw, mustMarshal(t, next))

			var req storev1.Request
			files, err := c.Recv(&req)
			if !errors.Is(err, ErrTooLarge) || files != nil {
				t.Fatalf("Recv = %d files, %v; want ErrTooLarge", len(files), err)
			}
			var me *MessageError
			if !errors.As(err, &me) || me.Op != "recv" {
				t.Fatalf("error %v is not a recv *MessageError", err)
			}
			if !probe.closedEverywhere(t) {
				t.Fatal("the fd attached to the oversized packet leaked")
			}
			if _, err := c.Recv(&req); err != nil || !proto.Equal(&req, next) {
				t.Fatalf("next packet: %v, %v", &req, err)
			}
		})
	}
}

func TestMaxSizePacketAccepted(t *testing.T) {
	client, server := connPair(t)
	// A list page of exactly MaxMessageSize bytes: grow the last name's
	// region until the encoding hits the limit.
	resp := &storev1.Response{Id: 1, Body: &storev1.Response_List{List: &storev1.ListResponse{
		Objects: []*storev1.ObjectInfo{{Name: "big", Size: 1}}}}}
	info := resp.GetList().Objects[0]
	for proto.Size(resp) < MaxMessageSize {
		info.Region = make([]byte, len(info.Region)+MaxMessageSize-proto.Size(resp))
	}
	for proto.Size(resp) > MaxMessageSize {
		info.Region = info.Region[:len(info.Region)-1]
	}
	if proto.Size(resp) != MaxMessageSize {
		t.Skipf("could not build a packet of exactly %d bytes (got %d)", MaxMessageSize, proto.Size(resp))
	}
	rand.Read(info.Region)
	if err := server.Send(resp); err != nil {
		t.Fatal(err)
	}
	var got storev1.Response
	if _, err := client.Recv(&got); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(&got, resp) {
		t.Fatal("max-size packet changed in transit")
	}
	info.Region = append(info.Region, 1)
	if err := server.Send(resp); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("Send of %d bytes = %v, want ErrTooLarge", proto.Size(resp), err)
	}
}

func TestGarbage(t *testing.T) {
	cases := map[string][]byte{
		"random":     append([]byte{0x00}, randomBytes(t, 100)...), // field number 0 is invalid
		"dummy byte": {0x00},                                       // what sendmsg sends for an empty packet with fds
		"truncated":  mustMarshal(t, createRequest(1, "truncated-name", 10))[:12],
		// Request{id: 1, create{name: "\xff\xfe"}}: proto3 strings must be UTF-8.
		"bad utf-8":     {0x08, 0x01, 0x5a, 0x04, 0x0a, 0x02, 0xff, 0xfe},
		"bad wire type": {0x0f},
	}
	for name, data := range cases {
		t.Run(name, func(t *testing.T) {
			raw, sock := socketpair(t)
			c := newConn(t, sock)
			probe := newLeakProbe(t)
			sendRaw(t, raw, data, int(probe.w.Fd()))
			var req storev1.Request
			files, err := c.Recv(&req)
			if !errors.Is(err, ErrMalformed) || files != nil {
				t.Fatalf("Recv = %d files, %v; want ErrMalformed", len(files), err)
			}
			if !probe.closedEverywhere(t) {
				t.Fatal("the fd attached to the malformed packet leaked")
			}
		})
	}
}

func TestTooManyFiles(t *testing.T) {
	// MaxFiles+1 fit in the receive buffer; 250 (just under the kernel's
	// SCM_MAX_FD, 253) overflow it (MSG_CTRUNC).
	for _, n := range []int{MaxFiles + 1, 250} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			raw, sock := socketpair(t)
			c := newConn(t, sock)
			probes := make([]*leakProbe, n)
			fds := make([]int, n)
			for i := range probes {
				probes[i] = newLeakProbe(t)
				fds[i] = int(probes[i].w.Fd())
			}
			sendRaw(t, raw, mustMarshal(t, createRequest(1, "x", 1)), fds...)
			var req storev1.Request
			files, err := c.Recv(&req)
			if !errors.Is(err, ErrTooManyFiles) || files != nil {
				t.Fatalf("Recv = %d files, %v; want ErrTooManyFiles", len(files), err)
			}
			for i, p := range probes {
				if !p.closedEverywhere(t) {
					t.Fatalf("fd %d of %d leaked", i, n)
				}
			}
		})
	}
	t.Run("send", func(t *testing.T) {
		c, _ := connPair(t)
		files := make([]*os.File, MaxFiles+1)
		for i := range files {
			files[i] = memfdWith(t, randomBytes(t, 8))
		}
		if err := c.Send(createRequest(1, "x", 1), files...); !errors.Is(err, ErrTooManyFiles) {
			t.Fatalf("Send = %v, want ErrTooManyFiles", err)
		}
	})
}

func TestSendRejectsBadMessages(t *testing.T) {
	c, _ := connPair(t)
	if err := c.Send(&storev1.Request{}); !errors.Is(err, ErrMalformed) {
		t.Errorf("empty message: %v, want ErrMalformed", err)
	}
	if err := c.Send(createRequest(1, "x", 1), nil); !errors.Is(err, ErrMalformed) {
		t.Errorf("nil file: %v, want ErrMalformed", err)
	}
	big := createRequest(1, strings.Repeat("n", MaxMessageSize), 1)
	if err := c.Send(big); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized: %v, want ErrTooLarge", err)
	}
}

func TestPeerClose(t *testing.T) {
	t.Run("recv", func(t *testing.T) {
		a, b := connPair(t)
		b.Close()
		var resp storev1.Response
		if _, err := a.Recv(&resp); err != io.EOF {
			t.Fatalf("Recv after peer close = %v, want io.EOF", err)
		}
	})
	t.Run("send", func(t *testing.T) {
		a, b := connPair(t)
		b.Close()
		if err := a.Send(createRequest(1, "x", 1)); !errors.Is(err, io.EOF) {
			t.Fatalf("Send after peer close = %v, want io.EOF", err)
		}
	})
	t.Run("unread data", func(t *testing.T) {
		// A peer that closes with our packets unread resets the connection.
		a, b := connPair(t)
		if err := a.Send(createRequest(1, "x", 1)); err != nil {
			t.Fatal(err)
		}
		b.Close()
		var resp storev1.Response
		if _, err := a.Recv(&resp); !errors.Is(err, io.EOF) {
			t.Fatalf("Recv after reset = %v, want an error matching io.EOF", err)
		}
	})
	t.Run("empty packet", func(t *testing.T) {
		// A zero-length packet is indistinguishable from end of stream.
		// (Sendmsg turns an empty packet with descriptors into one dummy
		// byte, which TestGarbage covers as malformed.)
		raw, sock := socketpair(t)
		c := newConn(t, sock)
		sendRaw(t, raw, nil)
		var req storev1.Request
		if files, err := c.Recv(&req); err != io.EOF || files != nil {
			t.Fatalf("Recv = %d files, %v; want io.EOF", len(files), err)
		}
	})
	t.Run("local close unblocks recv", func(t *testing.T) {
		a, _ := connPair(t)
		done := make(chan error)
		go func() {
			var resp storev1.Response
			_, err := a.Recv(&resp)
			done <- err
		}()
		a.Close()
		if err := <-done; !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Recv after Close = %v, want net.ErrClosed", err)
		}
	})
}

// TestConcurrent runs several senders against one receiver in each
// direction at once; run it with -race.
func TestConcurrent(t *testing.T) {
	client, server := connPair(t)
	const senders, perSender = 4, 200
	payload := randomBytes(t, 64)
	mem := memfdWith(t, payload)

	var wg sync.WaitGroup
	errs := make(chan error, 2*senders+2)
	for s := range senders {
		wg.Go(func() {
			for i := range perSender {
				id := uint64(s*perSender + i + 1)
				if err := client.Send(createRequest(id, fmt.Sprintf("obj-%d", id), id)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	// Server: answer every request, attaching the memfd to every tenth.
	wg.Go(func() {
		for range senders * perSender {
			var req storev1.Request
			files, err := server.Recv(&req)
			if err != nil {
				errs <- err
				return
			}
			CloseFiles(files)
			if err := ValidateRequest(&req, len(files)); err != nil {
				errs <- err
				return
			}
			size := req.GetCreate().GetSize()
			attach := req.GetId()%10 == 0
			resp := &storev1.Response{Id: req.GetId(), Body: &storev1.Response_Create{Create: &storev1.CreateResponse{
				Placement: &storev1.Placement{Kind: storev1.Placement_HOST, ArenaId: 1, Device: "host", Size: size, ArenaSize: size,
					Writable: true, FdAttached: attach}}}}
			var err2 error
			if attach {
				err2 = server.Send(resp, mem)
			} else {
				err2 = server.Send(resp)
			}
			if err2 != nil {
				errs <- err2
				return
			}
		}
	})
	seen := make(map[uint64]bool)
	wg.Go(func() {
		for range senders * perSender {
			var resp storev1.Response
			files, err := client.Recv(&resp)
			if err != nil {
				errs <- err
				return
			}
			if err := ValidateResponse(&resp, len(files)); err != nil {
				errs <- err
				return
			}
			if len(files) == 1 {
				got := make([]byte, len(payload))
				if _, err := files[0].ReadAt(got, 0); err != nil || !bytes.Equal(got, payload) {
					errs <- fmt.Errorf("memfd on response %d: %v", resp.GetId(), err)
				}
			}
			CloseFiles(files)
			seen[resp.GetId()] = true
		}
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if len(seen) != senders*perSender {
		t.Fatalf("saw %d distinct responses, want %d", len(seen), senders*perSender)
	}
}

func TestPeerCred(t *testing.T) {
	a, _ := connPair(t)
	cred, err := a.PeerCred()
	if err != nil {
		t.Fatal(err)
	}
	if int(cred.Pid) != os.Getpid() || int(cred.Uid) != os.Getuid() || int(cred.Gid) != os.Getgid() {
		t.Fatalf("PeerCred = %+v, want pid %d uid %d gid %d", cred, os.Getpid(), os.Getuid(), os.Getgid())
	}
}

// fakeServer accepts one connection on a fresh socket and hands it to serve.
func fakeServer(t *testing.T, serve func(*Conn)) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "store.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { l.Close(); <-done })
	go func() {
		defer close(done)
		uc, err := l.AcceptUnix()
		if err != nil {
			return
		}
		c := NewConn(uc)
		defer c.Close()
		serve(c)
	}()
	return path
}

// serveHello answers the handshake the way the store does.
func serveHello(c *Conn) {
	var req storev1.Request
	files, err := c.Recv(&req)
	if err != nil {
		return
	}
	if err := ValidateRequest(&req, len(files)); err != nil {
		CloseFiles(files)
		c.Send(ErrorResponse(req.GetId(), err))
		return
	}
	if err := CheckVersion(req.GetHello().GetVersion()); err != nil {
		c.Send(ErrorResponse(req.GetId(), err))
		return
	}
	c.Send(&storev1.Response{Id: req.GetId(), Body: &storev1.Response_Hello{Hello: &storev1.HelloResponse{
		Version: Version, ServerVersion: "test", Pid: uint32(os.Getpid()), Backend: "host"}}})
	// Wait for the client to go away.
	c.Recv(&req)
}

func TestDialAndHello(t *testing.T) {
	path := fakeServer(t, serveHello)
	c, err := Dial(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h, err := ClientHello(context.Background(), c, "protocol-test")
	if err != nil {
		t.Fatal(err)
	}
	if h.GetVersion() != Version || h.GetBackend() != "host" || h.GetPid() != uint32(os.Getpid()) {
		t.Fatalf("hello = %v", h)
	}
	cred, err := c.PeerCred()
	if err != nil || int(cred.Uid) != os.Getuid() {
		t.Fatalf("PeerCred = %+v, %v", cred, err)
	}
}

func TestHelloVersionRefused(t *testing.T) {
	path := fakeServer(t, func(c *Conn) {
		var req storev1.Request
		if _, err := c.Recv(&req); err != nil {
			return
		}
		// A server that only speaks a future version.
		c.Send(ErrorResponse(req.GetId(), Errorf(storev1.Error_VERSION, "server speaks version 2 only")))
	})
	c, err := Dial(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = ClientHello(context.Background(), c, "old-client")
	var ce *CodeError
	if !errors.Is(err, ErrVersion) || !errors.As(err, &ce) || ce.Code != storev1.Error_VERSION {
		t.Fatalf("ClientHello = %v, want a VERSION *CodeError", err)
	}
}

func TestHelloCanceled(t *testing.T) {
	received := make(chan struct{})
	path := fakeServer(t, func(c *Conn) {
		var req storev1.Request
		c.Recv(&req)
		close(received)
		c.Recv(&req) // never answer
	})
	c, err := Dial(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-received; cancel() }()
	if _, err := ClientHello(ctx, c, "impatient"); !errors.Is(err, context.Canceled) {
		t.Fatalf("ClientHello = %v, want context.Canceled", err)
	}
}

func TestDialNoServer(t *testing.T) {
	_, err := Dial(context.Background(), filepath.Join(t.TempDir(), "missing.sock"))
	if !errors.Is(err, unix.ENOENT) {
		t.Fatalf("Dial = %v, want ENOENT", err)
	}
}

// TestRecvSpin: a receive that polls gets packets that come within its
// window, and after it (from the netpoller), files included.
func TestRecvSpin(t *testing.T) {
	client, server := connPair(t)
	data := randomBytes(t, 4096)
	for _, wait := range []time.Duration{0, time.Millisecond, 30 * time.Millisecond} {
		name := fmt.Sprintf("obj-%x", data[:8])
		req := createRequest(uint64(wait)+1, name, 4096)
		f := memfdWith(t, data)
		go func() {
			time.Sleep(wait)
			client.Send(req, f)
		}()
		var got storev1.Request
		files, err := server.RecvSpin(&got, 5*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(&got, req) || len(files) != 1 {
			t.Fatalf("after %v: got %v with %d files, want %v with 1", wait, &got, len(files), req)
		}
		back := make([]byte, len(data))
		if _, err := files[0].ReadAt(back, 0); err != nil || !bytes.Equal(back, data) {
			t.Fatalf("after %v: the file received holds other bytes (%v)", wait, err)
		}
		CloseFiles(files)
		f.Close()
		data = randomBytes(t, 4096)
	}
}

// TestRecvSpinDeadline: a read deadline stops a receive that polls, within
// a window far longer than the test: one set before, and one set in the
// past while it polls (how the client interrupts a reader).
func TestRecvSpinDeadline(t *testing.T) {
	_, server := connPair(t)
	recv := func() error {
		done := make(chan error, 1)
		go func() {
			var got storev1.Request
			_, err := server.RecvSpin(&got, time.Hour)
			done <- err
		}()
		select {
		case err := <-done:
			return err
		case <-time.After(time.Minute): // a hang, not a measurement
			t.Fatal("RecvSpin ignored the read deadline")
			return nil
		}
	}
	server.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if err := recv(); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("deadline set before: got %v, want os.ErrDeadlineExceeded", err)
	}
	server.SetReadDeadline(time.Time{})
	server.spinSkip = 0 // the window above found nothing: poll again
	go func() {
		time.Sleep(20 * time.Millisecond)
		server.SetReadDeadline(time.Unix(1, 0))
	}()
	if err := recv(); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("deadline set in the past while polling: got %v, want os.ErrDeadlineExceeded", err)
	}
}
