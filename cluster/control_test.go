package cluster

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"net"
	"testing"
	"time"
)

type oneObject struct {
	ref Ref
	id  string
}

func (s oneObject) Expose(ref Ref, id string) (Exposure, func(), error) {
	if ref != s.ref || id != s.id {
		return Exposure{}, nil, ErrNotFound
	}
	return Exposure{Worker: []byte("w"), RKey: []byte("k"), Addr: 0x1000, Size: 10}, func() {}, nil
}

func serveControl(t *testing.T, s Secret, src Source) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cs := &ControlServer{Node: "srv", Secret: s, Source: src}
	done := make(chan struct{})
	go func() { cs.Serve(ln); close(done) }()
	t.Cleanup(func() {
		ln.Close()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("control server did not stop within 5s")
		}
	})
	return ln.Addr().String()
}

// dialServed serves src on a control channel and dials it: the client and
// a context of 10 s for its calls, both ended when the test ends.
func dialServed(t *testing.T, src Source) (context.Context, *ControlClient) {
	t.Helper()
	addr := serveControl(t, testSecret, src)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	cc, err := DialControl(ctx, testSecret, "cli", "srv", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return ctx, cc
}

func TestControlOpen(t *testing.T) {
	ref := Ref{Owner: 1, Name: "x"}
	id := NewID()
	ctx, cc := dialServed(t, oneObject{ref, id})
	e, h, err := cc.Open(ctx, ref, id)
	if err != nil || e.Size != 10 || h == 0 || cc.Peer() != "srv" {
		t.Fatalf("open: %+v %d %v", e, h, err)
	}
	if err := cc.Release(ctx, h); err != nil {
		t.Fatal(err)
	}
	if _, _, err := cc.Open(ctx, ref, NewID()); !errors.Is(err, ErrNotFound) {
		t.Fatalf("open of another incarnation: %v", err)
	}
}

func TestControlRefusals(t *testing.T) {
	addr := serveControl(t, testSecret, oneObject{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	other, _ := NewSecret([]byte("some-other-secret-16+"))
	if _, err := DialControl(ctx, other, "cli", "srv", addr); !errors.Is(err, ErrAuth) {
		t.Fatalf("wrong secret: %v", err)
	}
	// Garbage, a huge length, a truncated frame, a bad hello: the server
	// drops each connection and keeps serving.
	for _, junk := range [][]byte{
		[]byte("GET / HTTP/1.1\r\n\r\n"),
		{0xff, 0xff, 0xff, 0xff},
		{0, 0, 0, 10, '{'},
		frame([]byte(`{"proto":"cudaipc-control/1","node":"x","nonce":"AAAA"}`)),
		frame([]byte(`{"proto":"cudaipc-control/1","node":"../x","nonce":"` + b64(32) + `"}`)),
	} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(HandshakeTimeout + 5*time.Second))
		c.Write(junk)
		if cw, ok := c.(*net.TCPConn); ok {
			cw.CloseWrite()
		}
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				break
			}
		}
		c.Close()
	}
	cc, err := DialControl(ctx, testSecret, "cli", "srv", addr)
	if err != nil {
		t.Fatalf("server after junk: %v", err)
	}
	cc.Close()
}

func frame(b []byte) []byte {
	var buf bytes.Buffer
	writeFrame(&buf, b)
	return buf.Bytes()
}

func b64(n int) string {
	b, _ := json.Marshal(make([]byte, n))
	return string(b[1 : len(b)-1])
}

func FuzzDecodeHello(f *testing.F) {
	b, _ := json.Marshal(ctlHello{Proto: controlProto, Node: "a", Nonce: make([]byte, nonceLen), MAC: make([]byte, macLen)})
	f.Add(b)
	f.Add([]byte(`{"refused":"x"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHello(b)
		if err != nil {
			if !errors.Is(err, ErrBadRecord) {
				t.Fatalf("error does not wrap ErrBadRecord: %v", err)
			}
			return
		}
		if h.Refused == "" && (len(h.Nonce) != nonceLen || ValidateNodeName(h.Node) != nil) {
			t.Fatalf("accepted %+v", h)
		}
	})
}

// FuzzChannel feeds arbitrary frames to an established channel's reader,
// both as received and sealed correctly (a peer with the secret and a bug).
func FuzzChannel(f *testing.F) {
	b, _ := json.Marshal(ctlResponse{Handle: 1, Exposure: Exposure{Worker: []byte("w"), RKey: []byte("k"), Addr: 1, Size: 1}})
	f.Add(b)
	f.Add([]byte(`{"err":"x","not_held":true}`))
	f.Fuzz(func(t *testing.T, payload []byte) {
		tr := transcript(make([]byte, 32), make([]byte, 32), "a", "b")
		for _, sealed := range []bool{false, true} {
			var wire bytes.Buffer
			if sealed {
				var nonce [12]byte
				binary.BigEndian.PutUint64(nonce[4:], 0)
				writeFrame(&wire, testSecret.aead("s2c", tr).Seal(nil, nonce[:], payload, nil))
			} else {
				writeFrame(&wire, payload)
			}
			c1, c2 := net.Pipe()
			go func() { c1.Write(wire.Bytes()); c1.Close() }()
			ch := &channel{c: c2, peer: "b", sendAEAD: testSecret.aead("c2s", tr), recv: testSecret.aead("s2c", tr)}
			var resp ctlResponse
			err := ch.read(&resp)
			c2.Close()
			if err != nil {
				if !errors.Is(err, ErrBadRecord) {
					t.Fatalf("error does not wrap ErrBadRecord: %v", err)
				}
				continue
			}
			if !sealed {
				t.Fatal("an unsealed frame was accepted")
			}
			if resp.Err == "" {
				_ = resp.Exposure.validate() // must not panic
			}
		}
	})
}
