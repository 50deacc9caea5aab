package cluster

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/testutil"
)

// boundedServer serves oneObject{ref, id} with the given bounds, logging
// into the returned buffer.
func boundedServer(t *testing.T, perSource, pending, channels int, ref Ref, id string) (*ControlServer, string, *testutil.SyncBuffer) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var logs testutil.SyncBuffer
	cs := &ControlServer{Node: "srv", Secret: testSecret, Source: oneObject{ref, id},
		Logger:              slog.New(slog.NewTextHandler(&logs, nil)),
		MaxPendingPerSource: perSource, MaxPending: pending, MaxChannels: channels}
	done := make(chan struct{})
	go func() { cs.Serve(ln); close(done) }()
	t.Cleanup(func() {
		ln.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("control server did not stop within 10s")
		}
	})
	return cs, ln.Addr().String(), &logs
}

// holdFrom opens n connections to addr from source address src and sends
// nothing on them; they are closed when the test ends.
func holdFrom(t *testing.T, src, addr string, n int) []net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	var cs []net.Conn
	for range n {
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		cs = append(cs, c)
	}
	return cs
}

// TestControlPendingBounds: connections that do not authenticate are
// bounded per source address and in all; one over a bound is closed at
// once, a full server makes room for a peer from another address by
// closing the oldest of the source holding the most, every held one is
// closed at the handshake deadline, and the log gets a bounded number of
// lines about them all.
func TestControlPendingBounds(t *testing.T) {
	ref, id := Ref{Owner: 1, Name: "x"}, NewID()
	cs, addr, logs := boundedServer(t, 4, 8, 0, ref, id)
	holdFrom(t, "127.0.0.2", addr, 10)
	testutil.Eventually(t, testutil.Wait, func() error {
		if st := cs.Stats(); st.Pending != 4 || st.Refused[RefusedSourceLimit] != 6 {
			return fmt.Errorf("%+v: want 4 pending, 6 refused over the source's bound", st)
		}
		return nil
	})
	holdFrom(t, "127.0.0.3", addr, 4)
	// Full: a third source's first connection takes the place of the
	// oldest of a source holding 4.
	holdFrom(t, "127.0.0.4", addr, 1)
	testutil.Eventually(t, testutil.Wait, func() error {
		if st := cs.Stats(); st.Pending != 8 || st.Refused[RefusedPendingLimit] != 1 {
			return fmt.Errorf("%+v: want 8 pending, 1 closed to make room", st)
		}
		return nil
	})
	// An authenticated peer from yet another address gets in as well.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	cc, err := DialControl(ctx, testSecret, "cli", "srv", addr)
	if err != nil {
		t.Fatalf("a peer with the secret, beside 8 held connections: %v", err)
	}
	defer cc.Close()
	if _, h, err := cc.Open(ctx, ref, id); err != nil || h == 0 {
		t.Fatalf("open beside held connections: %v", err)
	}
	if st := cs.Stats(); st.Channels != 1 {
		t.Fatalf("%+v: want 1 channel", st)
	}
	// The peer's connection took the place of another held one; every
	// held one left is closed at the handshake deadline.
	testutil.Eventually(t, testutil.Wait, func() error {
		if st := cs.Stats(); st.Pending != 0 || st.Refused[RefusedPendingLimit] != 2 || st.Refused[RefusedTimeout] != 7 {
			return fmt.Errorf("%+v: want none pending, 2 closed to make room, 7 timed out", st)
		}
		return nil
	})
	t.Logf("the held connections closed within %v of the peer's dial (deadline %v)", time.Since(start).Round(time.Millisecond), HandshakeTimeout)
	if l := strings.Count(logs.String(), "\n"); l > refusalLogBurst {
		t.Fatalf("%d log lines about 16 refusals, want at most %d:\n%s", l, refusalLogBurst, logs.String())
	}
}

// TestControlChannelBound: an authenticated peer beyond MaxChannels is
// closed after its handshake, and counted; the channels within the bound
// keep working.
func TestControlChannelBound(t *testing.T) {
	ref, id := Ref{Owner: 1, Name: "x"}, NewID()
	cs, addr, _ := boundedServer(t, 0, 0, 1, ref, id)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	first, err := DialControl(ctx, testSecret, "cli", "srv", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	// The dialler's handshake ends with its own proof, before the server
	// has checked it and counted the channel: wait for the count, or the
	// second dial could take the place first.
	testutil.Eventually(t, testutil.Wait, func() error {
		if st := cs.Stats(); st.Channels != 1 {
			return fmt.Errorf("%+v: want the first channel counted", st)
		}
		return nil
	})
	second, err := DialControl(ctx, testSecret, "cli", "srv", addr)
	if err == nil {
		defer second.Close()
		if _, _, err = second.Open(ctx, ref, id); err == nil {
			t.Fatal("a second channel beyond MaxChannels 1 served an open")
		}
	}
	if _, _, err := first.Open(ctx, ref, id); err != nil {
		t.Fatalf("the first channel after the second was refused: %v", err)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if st := cs.Stats(); st.Channels != 1 || st.Refused[RefusedChannelLimit] != 1 {
			return fmt.Errorf("%+v: want 1 channel, 1 refused over the bound", st)
		}
		return nil
	})
}

// TestControlJunkRefusalsLogged: a peer sending junk is refused as
// malformed, one closing mid-handshake as closed, one with the wrong
// secret as auth; each gets a line while the burst lasts.
func TestControlJunkRefusalsLogged(t *testing.T) {
	cs, addr, logs := boundedServer(t, 0, 0, 0, Ref{Name: "x"}, NewID())
	send := func(b []byte) {
		c := holdFrom(t, "127.0.0.1", addr, 1)[0]
		c.Write(b)
		c.(*net.TCPConn).CloseWrite()
		c.SetReadDeadline(time.Now().Add(testutil.Wait))
		buf := make([]byte, 512)
		for {
			if _, err := c.Read(buf); err != nil {
				break
			}
		}
		c.Close()
	}
	send(frame([]byte(`{"proto":"cudaipc-control/1","node":"x","nonce":"AAAA"}`)))
	send([]byte{0, 0, 0, 10, '{'})
	send([]byte{0, 0x10, 0, 0}) // a 1 MiB frame announced: over the handshake's bound
	other, _ := NewSecret([]byte("some-other-secret-16+"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := DialControl(ctx, other, "cli", "srv", addr); err == nil {
		t.Fatal("a wrong secret authenticated")
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		st := cs.Stats()
		if st.Refused[RefusedMalformed] != 2 || st.Refused[RefusedClosed] != 1 || st.Refused[RefusedAuth] != 1 {
			return fmt.Errorf("%+v: want 2 malformed, 1 closed, 1 auth", st)
		}
		return nil
	})
	// A refusal is counted before its line is written: wait for the lines.
	testutil.Eventually(t, testutil.Wait, func() error {
		for _, want := range []string{"reason=malformed", "reason=closed", "reason=auth", "source=127.0.0.1"} {
			if !strings.Contains(logs.String(), want) {
				return fmt.Errorf("no line with %s:\n%s", want, logs.String())
			}
		}
		return nil
	})
}
