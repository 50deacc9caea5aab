package node

import (
	"errors"
	"net"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// freePort is a loopback port nothing listens on (at the time of asking).
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// TestListenControlDefault: without a listen address the control channel
// listens at the advertised address only, not on every interface; with
// neither, at the address towards etcd with the default port.
func TestListenControlDefault(t *testing.T) {
	port := freePort(t)
	adv := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	ln, got, err := listenControl("", adv, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if got != adv || ln.Addr().String() != adv {
		t.Fatalf("listening at %s, advertising %s; want both %s", ln.Addr(), got, adv)
	}
	// Another loopback address of the host reaches no listener.
	if c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.2", strconv.Itoa(port)), 5*time.Second); err == nil {
		c.Close()
		t.Fatal("the control port answers on 127.0.0.2: it listens on every interface")
	}
	ln2, got2, err := listenControl("", "", []string{"http://127.0.0.1:2379"})
	if errors.Is(err, syscall.EADDRINUSE) {
		t.Skipf("port %d of loopback is taken on this host: %v", DefaultControlPort, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer ln2.Close()
	want := net.JoinHostPort("127.0.0.1", strconv.Itoa(DefaultControlPort))
	if got2 != want || ln2.Addr().String() != want {
		t.Fatalf("with etcd on loopback: listening at %s, advertising %s; want both %s", ln2.Addr(), got2, want)
	}
}

// TestListenControlInUse: a port taken (another daemon on the host) fails
// in one line that names --cluster-listen and another port, wrapping the
// system's error.
func TestListenControlInUse(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	addr := taken.Addr().String()
	port := taken.Addr().(*net.TCPAddr).Port
	for _, c := range []struct{ listen, adv, flag string }{
		{addr, "", "--cluster-listen"},
		{"", addr, "--cluster-advertise"},
	} {
		_, _, err := listenControl(c.listen, c.adv, []string{"http://127.0.0.1:2379"})
		if !errors.Is(err, syscall.EADDRINUSE) {
			t.Fatalf("listen %q advertise %q on a taken port: %v, want EADDRINUSE", c.listen, c.adv, err)
		}
		msg := err.Error()
		t.Log(msg)
		if strings.Contains(msg, "\n") || !strings.Contains(msg, c.flag) || !strings.Contains(msg, "--cluster-listen HOST:PORT") ||
			!strings.Contains(msg, strconv.Itoa(port+1)) {
			t.Fatalf("error %q: want one line naming %s, --cluster-listen and port %d", msg, c.flag, port+1)
		}
	}
}
