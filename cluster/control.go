package cluster

import (
	"bufio"
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cudaipc/cudaipc/internal/loglimit"
)

// The control channel: a TCP connection between two daemons over which they
// authenticate each other with the cluster secret and then exchange what
// lets the reader GET an object's memory (the holder's UCX worker address,
// the rkey, the address). Nothing about memory crosses before both sides
// have proved the secret, and everything after the handshake is sealed with
// AES-256-GCM under keys derived from the secret and both nonces.
//
// Handshake (frames are a 4-byte big-endian length, then the payload):
//
//	C → S  hello  {proto, node C, nonce C}
//	S → C  hello  {proto, node S, nonce S, MAC_S = H(k, "server" ‖ T)}
//	C → S  proof  {MAC_C = H(k, "client" ‖ T)}
//
// where T = nonce C ‖ nonce S ‖ node C ‖ 0 ‖ node S and H is HMAC-SHA256
// under a key derived from the secret for this purpose. Either side that
// finds a MAC wrong sends a refusal and closes. A relay between two genuine
// daemons learns nothing: it cannot decrypt what follows.
//
// After the handshake a client may have up to MaxInFlight requests under
// way on one channel: each carries a tag its answer repeats, the server
// serves them side by side and answers each as it is done. A frame's
// nonce is its sequence number in its direction, and frames are sealed
// and written under one lock, in that order, so that no nonce is ever
// used twice under a key: concurrent requests share the count, never
// restart it. A peer speaking the first version of the protocol sends one
// request at a time and is answered as before.

const (
	controlProto = "cudaipc-control/2"
	// controlProtoSerial is the first version: no tags, one request at a
	// time. A server still answers its peers.
	controlProtoSerial = "cudaipc-control/1"
	// MaxInFlight bounds the requests under way on one control channel:
	// a client's next waits for a place, and a server reads no more from
	// a peer while it serves that many of its requests.
	MaxInFlight = 256
	// controlWriteTimeout bounds a write of the channel without a
	// caller's deadline: a peer that reads nothing for that long is
	// dropped.
	controlWriteTimeout = 30 * time.Second
	// MaxControlFrame bounds a control frame.
	MaxControlFrame = 1 << 20
	// HandshakeTimeout bounds a whole handshake, from the connection's
	// accept (or dial) to the peer's proof: a connection that has not
	// authenticated by then is closed.
	HandshakeTimeout = 3 * time.Second
	// maxHandshakeFrame bounds a frame of the handshake (a hello or a
	// proof is some 200 bytes), so that a connection not yet
	// authenticated never makes the server allocate more.
	maxHandshakeFrame = 4 << 10
	// MaxExposures bounds the objects one control connection holds
	// exposed at once.
	MaxExposures = 1024
	nonceLen     = 32
	// channelBuffer is a channel's read buffer: an inline read's answer
	// and bytes fit.
	channelBuffer = MaxInline + 4<<10
)

type ctlHello struct {
	Proto string `json:"proto"`
	Node  string `json:"node"`
	Nonce []byte `json:"nonce"`
	MAC   []byte `json:"mac,omitempty"`
	// Refused is set instead when the sender refuses the peer.
	Refused string `json:"refused,omitempty"`
}

type ctlProof struct {
	MAC     []byte `json:"mac,omitempty"`
	Refused string `json:"refused,omitempty"`
}

// ctlRequest is a request after the handshake.
type ctlRequest struct {
	// Tag, set by a client of the current protocol, is repeated in the
	// answer: requests are answered as they are done, not in order.
	Tag uint64 `json:"tag,omitempty"`
	// Op is "open" (expose Ref's replica of incarnation ID), "read"
	// (send a small one's bytes: inline.go) or "close" (release Handle).
	Op     string `json:"op"`
	Ref    Ref    `json:"ref"`
	ID     string `json:"id,omitempty"`
	Handle uint64 `json:"handle,omitempty"`
	// Known is, for "have" (fanout.go), how many chunks the reader knows
	// the feeder has.
	Known int `json:"known,omitempty"`
	// Reader, Space, Regions and Stage are, for "kvopen" (kvspace.go), the
	// uid of the reader, the KV space's description, the regions to expose
	// and, for a staged read, its blocks.
	Reader  uint32      `json:"reader,omitempty"`
	Space   []byte      `json:"space,omitempty"`
	Regions []int       `json:"regions,omitempty"`
	Stage   *SpaceStage `json:"stage,omitempty"`
	// Payload is, for "kvnotify" (kvspace.go), the notice for the space's
	// engine.
	Payload []byte `json:"payload,omitempty"`
	// Pool, KeyBytes, Count and Shape are, for the pool ops (kvpool.go),
	// the pool's qualified name, its key size, the request's keys and the
	// pool's shape; Staged a put's blocks staged on the sender, TimeoutMs
	// how long a put's owner has to fetch them.
	Pool      string      `json:"pool,omitempty"`
	KeyBytes  int         `json:"key_bytes,omitempty"`
	Count     int         `json:"count,omitempty"`
	Shape     *PoolShape  `json:"shape,omitempty"`
	Staged    *PoolStaged `json:"staged,omitempty"`
	TimeoutMs int64       `json:"timeout_ms,omitempty"`
	// Inline says that a frame of this many bytes follows the request
	// (the pool ops' keys, and a put's blocks inline after them).
	Inline int64 `json:"inline,omitempty"`
	// Batch is, for "kvreads" (kvbatch.go), the small reads it carries.
	Batch []ctlSpaceRead `json:"batch,omitempty"`
}

// ctlResponse answers a ctlRequest.
type ctlResponse struct {
	// Tag is the request's.
	Tag uint64 `json:"tag,omitempty"`
	Err string `json:"err,omitempty"`
	// NotHeld: the node does not hold that incarnation (any more).
	NotHeld bool `json:"not_held,omitempty"`
	Handle  uint64
	Exposure
	// Have, Chunks and Complete answer "feed" and "have" (fanout.go):
	// which chunks a feeder has (a bit per chunk), how many, or that it
	// has them all.
	Have     []byte `json:"have,omitempty"`
	Chunks   int    `json:"chunks,omitempty"`
	Complete bool   `json:"complete,omitempty"`
	// Inline answers "read": the replica's bytes, this many, follow in
	// the next frame.
	Inline int64 `json:"inline,omitempty"`
	// Regions answers "kvopen" (kvspace.go): where each region asked for
	// lies, read through the worker of Exposure.Worker.
	Regions []SpaceRegion `json:"space_regions,omitempty"`
	// Found, Deleted, Status and Mask answer the pool ops (kvpool.go): a
	// lookup's present prefix, the keys a delete removed, a put's status
	// of each key, and which keys a get found (a bit a key, from bit 0 of
	// byte 0), whose blocks follow inline or lie in Regions[0].
	Found   int    `json:"found,omitempty"`
	Deleted int    `json:"deleted,omitempty"`
	Status  []byte `json:"status,omitempty"`
	Mask    []byte `json:"mask,omitempty"`
	// Batch answers "kvreads" (kvbatch.go): each read's, their bytes in
	// the frame after the answer (Inline: all of them).
	Batch []ctlSpaceAnswer `json:"batch,omitempty"`
}

// Exposure says where a peer reads an exposed replica: the holder's UCX
// worker address, the rkey of the registered memory, and the object's
// remote address in it.
type Exposure struct {
	Worker []byte `json:"worker"`
	RKey   []byte `json:"rkey"`
	Addr   uint64 `json:"addr"`
	Size   int64  `json:"size"`
}

func (e *Exposure) validate() error {
	if len(e.Worker) == 0 || len(e.Worker) > MaxWorkerAddrLen {
		return fmt.Errorf("%w: worker address of %d bytes", ErrBadRecord, len(e.Worker))
	}
	if len(e.RKey) == 0 || len(e.RKey) > MaxWorkerAddrLen {
		return fmt.Errorf("%w: rkey of %d bytes", ErrBadRecord, len(e.RKey))
	}
	if e.Size <= 0 || e.Addr+uint64(e.Size) < e.Addr {
		return fmt.Errorf("%w: exposure of %d bytes at %#x", ErrBadRecord, e.Size, e.Addr)
	}
	return nil
}

func writeFrame(w io.Writer, b []byte) error {
	if len(b) > MaxControlFrame {
		return fmt.Errorf("control frame of %d bytes, at most %d", len(b), MaxControlFrame)
	}
	buf := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(buf, uint32(len(b)))
	copy(buf[4:], b)
	_, err := w.Write(buf)
	return err
}

func readFrame(r io.Reader) ([]byte, error) { return readFrameMax(r, MaxControlFrame) }

// readFrameMax reads a frame of at most limit bytes.
func readFrameMax(r io.Reader, limit uint32) ([]byte, error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(h[:])
	if n > limit {
		return nil, fmt.Errorf("%w: control frame of %d bytes, at most %d", ErrBadRecord, n, limit)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	return b, nil
}

func decodeStrict(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return fmt.Errorf("%w: control message: %v", ErrBadRecord, err)
	}
	if d.More() {
		return fmt.Errorf("%w: control message: trailing data", ErrBadRecord)
	}
	return nil
}

// decodeHello parses and checks a peer's hello.
func decodeHello(b []byte) (ctlHello, error) {
	var h ctlHello
	if err := decodeStrict(b, &h); err != nil {
		return h, err
	}
	if h.Refused != "" {
		return h, nil
	}
	if h.Proto != controlProto && h.Proto != controlProtoSerial {
		return h, fmt.Errorf("%w: control protocol %q, want %q", ErrBadRecord, h.Proto, controlProto)
	}
	if err := ValidateNodeName(h.Node); err != nil {
		return h, fmt.Errorf("%w: %v", ErrBadRecord, err)
	}
	if len(h.Nonce) != nonceLen {
		return h, fmt.Errorf("%w: nonce of %d bytes", ErrBadRecord, len(h.Nonce))
	}
	if h.MAC != nil && len(h.MAC) != macLen {
		return h, fmt.Errorf("%w: MAC of %d bytes", ErrBadRecord, len(h.MAC))
	}
	return h, nil
}

func transcript(nc, ns []byte, nodeC, nodeS string) []byte {
	t := append(append([]byte(nil), nc...), ns...)
	t = append(t, nodeC...)
	t = append(t, 0)
	return append(t, nodeS...)
}

func (s Secret) handshakeMAC(role string, t []byte) []byte {
	m := s.mac("control " + role)
	m.Write(t)
	return m.Sum(nil)
}

// channel is an authenticated, sealed control connection. One goroutine
// reads it (read, readRaw); any number write to it (write, send).
type channel struct {
	c net.Conn
	// r buffers reads of c after the handshake (nil: read c directly),
	// so that a frame and the one after it come in one read.
	r    *bufio.Reader
	peer string
	// serial: the peer speaks the first version of the protocol (no
	// tags, one request at a time).
	serial   bool
	sendAEAD cipher.AEAD
	recv     cipher.AEAD
	rseq     uint64

	// wmu guards the sending side: sseq, and the frames sealed but not
	// written yet. A sender that finds no write under way writes them all
	// (its own and those others add meanwhile) in as few writes as it
	// can; one that finds a write under way leaves its frames to it.
	wmu     sync.Mutex
	sseq    uint64
	out     []byte // sealed frames not written yet
	spare   []byte // the buffer of the last write, for the next frames
	writing bool
	werr    error // the write that failed: the channel is broken
}

func (s Secret) aead(purpose string, t []byte) cipher.AEAD {
	k := s.handshakeMAC(purpose, t) // 32 bytes: AES-256
	b, err := aes.NewCipher(k)
	if err != nil {
		panic(err) // a 32-byte key is always valid
	}
	g, err := cipher.NewGCM(b)
	if err != nil {
		panic(err)
	}
	return g
}

// send seals v and, when raw is not nil, raw as the frame after it, and
// writes both (with other senders' frames) at once, so that the peer
// reads them together. A write in progress bounds itself by deadline (no
// deadline: controlWriteTimeout from now); a write that fails or times
// out breaks the channel (its connection is closed: a frame may be cut).
// send may return before its frames are written by another sender; a
// failure of that write fails the channel's next sends and its reader.
func (ch *channel) send(v any, raw []byte, deadline time.Time) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	o := ch.sendAEAD.Overhead()
	if n := len(b) + o; n > MaxControlFrame {
		return fmt.Errorf("control frame of %d bytes, at most %d", n, MaxControlFrame)
	}
	if n := len(raw) + o; raw != nil && n > MaxControlFrame {
		return fmt.Errorf("control frame of %d bytes, at most %d", n, MaxControlFrame)
	}
	ch.wmu.Lock()
	if ch.werr != nil {
		err := ch.werr
		ch.wmu.Unlock()
		return err
	}
	ch.out = ch.seal(ch.out, b)
	if raw != nil {
		ch.out = ch.seal(ch.out, raw)
	}
	if ch.writing {
		ch.wmu.Unlock()
		return nil
	}
	ch.writing = true
	for len(ch.out) > 0 && ch.werr == nil {
		buf := ch.out
		ch.out = ch.spare[:0]
		ch.wmu.Unlock()
		if deadline.IsZero() {
			deadline = time.Now().Add(controlWriteTimeout)
		}
		_ = ch.c.SetWriteDeadline(deadline)
		_, err := ch.c.Write(buf)
		ch.wmu.Lock()
		ch.spare = buf[:0]
		if err != nil {
			ch.werr, ch.out = err, nil
			ch.c.Close()
		}
	}
	ch.writing = false
	err = ch.werr
	if cap(ch.spare) > 2*channelBuffer {
		ch.spare = nil // a burst's buffer: let it go
	}
	ch.wmu.Unlock()
	return err
}

// seal appends b, at most MaxControlFrame bytes sealed, to dst as the
// next frame. Under wmu.
func (ch *channel) seal(dst, b []byte) []byte {
	var nonce [12]byte
	binary.BigEndian.PutUint64(nonce[4:], ch.sseq)
	ch.sseq++
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(b)+ch.sendAEAD.Overhead()))
	return ch.sendAEAD.Seal(dst, nonce[:], b, nil)
}

func (ch *channel) read(v any) error {
	p, err := ch.readRaw()
	if err != nil {
		return err
	}
	return decodeStrict(p, v)
}

// readRaw reads and opens the next frame.
func (ch *channel) readRaw() ([]byte, error) {
	var r io.Reader = ch.c
	if ch.r != nil {
		r = ch.r
	}
	b, err := readFrame(r)
	if err != nil {
		return nil, err
	}
	var nonce [12]byte
	binary.BigEndian.PutUint64(nonce[4:], ch.rseq)
	ch.rseq++
	p, err := ch.recv.Open(b[:0], nonce[:], b, nil)
	if err != nil {
		return nil, fmt.Errorf("%w: control frame from %s does not authenticate", ErrBadRecord, ch.peer)
	}
	return p, nil
}

func newNonce() []byte {
	b := make([]byte, nonceLen)
	rand.Read(b) // never fails: crypto/rand crashes the program instead
	return b
}

// clientHandshake authenticates conn's peer, which must be node want.
func clientHandshake(conn net.Conn, s Secret, self, want string) (*channel, error) {
	return clientHandshakeProto(conn, s, self, want, controlProto)
}

// clientHandshakeProto is clientHandshake in protocol version proto.
func clientHandshakeProto(conn net.Conn, s Secret, self, want, proto string) (*channel, error) {
	nc := newNonce()
	b, _ := json.Marshal(ctlHello{Proto: proto, Node: self, Nonce: nc})
	if err := writeFrame(conn, b); err != nil {
		return nil, err
	}
	b, err := readFrame(conn)
	if err != nil {
		return nil, fmt.Errorf("%w: node %s closed the handshake: %v", ErrAuth, want, err)
	}
	h, err := decodeHello(b)
	if err != nil {
		return nil, err
	}
	if h.Refused != "" {
		return nil, fmt.Errorf("%w: refused by node %s: %s", ErrAuth, want, h.Refused)
	}
	if h.Node != want {
		return nil, fmt.Errorf("%w: dialled node %s but %s answered", ErrAuth, want, h.Node)
	}
	if h.Proto != proto {
		return nil, fmt.Errorf("%w: node %s answered in control protocol %q, not %q", ErrBadRecord, want, h.Proto, proto)
	}
	t := transcript(nc, h.Nonce, self, h.Node)
	if !hmac.Equal(h.MAC, s.handshakeMAC("server", t)) {
		b, _ := json.Marshal(ctlProof{Refused: "your proof of the cluster secret is wrong"})
		_ = writeFrame(conn, b)
		return nil, fmt.Errorf("%w: node %s does not hold this cluster's secret", ErrAuth, want)
	}
	b, _ = json.Marshal(ctlProof{MAC: s.handshakeMAC("client", t)})
	if err := writeFrame(conn, b); err != nil {
		return nil, err
	}
	return &channel{c: conn, r: bufio.NewReaderSize(conn, channelBuffer), peer: want, serial: proto == controlProtoSerial, sendAEAD: s.aead("c2s", t), recv: s.aead("s2c", t)}, nil
}

// serverHandshake authenticates a connecting peer.
func serverHandshake(conn net.Conn, s Secret, self string) (*channel, error) {
	b, err := readFrameMax(conn, maxHandshakeFrame)
	if err != nil {
		return nil, err
	}
	h, err := decodeHello(b)
	if err != nil {
		return nil, err
	}
	if h.Refused != "" || h.MAC != nil {
		return nil, fmt.Errorf("%w: not a client hello", ErrBadRecord)
	}
	ns := newNonce()
	t := transcript(h.Nonce, ns, h.Node, self)
	b, _ = json.Marshal(ctlHello{Proto: h.Proto, Node: self, Nonce: ns, MAC: s.handshakeMAC("server", t)})
	if err := writeFrame(conn, b); err != nil {
		return nil, err
	}
	b, err = readFrameMax(conn, maxHandshakeFrame)
	if err != nil {
		return nil, fmt.Errorf("%w: %s closed the handshake: %w", ErrAuth, h.Node, err)
	}
	var p ctlProof
	if err := decodeStrict(b, &p); err != nil {
		return nil, err
	}
	if p.Refused != "" {
		return nil, fmt.Errorf("%w: %s refused this node: %s", ErrAuth, h.Node, p.Refused)
	}
	if !hmac.Equal(p.MAC, s.handshakeMAC("client", t)) {
		b, _ := json.Marshal(ctlProof{Refused: "wrong cluster secret"})
		_ = writeFrame(conn, b)
		return nil, fmt.Errorf("%w: peer calling itself %s does not hold this cluster's secret", ErrAuth, h.Node)
	}
	return &channel{c: conn, r: bufio.NewReaderSize(conn, channelBuffer), peer: h.Node, serial: h.Proto == controlProtoSerial, sendAEAD: s.aead("s2c", t), recv: s.aead("c2s", t)}, nil
}

// Source is the local store as the control service sees it.
type Source interface {
	// Expose keeps the local replica of ref, incarnation id, from being
	// evicted or reused until release is called, and says where a peer
	// reads it. It fails with an error wrapping ErrNotFound when this node
	// holds no such replica.
	Expose(ref Ref, id string) (e Exposure, release func(), err error)
}

// Bounds of a ControlServer's connections (ControlServer's fields of the
// same names, when those are 0).
const (
	// DefaultMaxPendingPerSource bounds the connections not yet
	// authenticated from one source: an IPv4 address, or an IPv6 /64.
	DefaultMaxPendingPerSource = 16
	// DefaultMaxPending bounds the connections not yet authenticated in
	// all.
	DefaultMaxPending = 256
	// DefaultMaxChannels bounds the authenticated channels: every other
	// node of the cluster keeps one to this node between pulls, and
	// dials another only to replace a stale one, so this serves
	// clusters of up to about a thousand nodes.
	DefaultMaxChannels = 1024
)

// Refusal reasons, as the control server's log lines and Stats count
// them.
const (
	// RefusedClosed: the peer closed the connection before it
	// authenticated.
	RefusedClosed = "closed"
	// RefusedTimeout: the peer had not authenticated within
	// HandshakeTimeout.
	RefusedTimeout = "timeout"
	// RefusedMalformed: the peer sent something other than a handshake.
	RefusedMalformed = "malformed"
	// RefusedAuth: the peer does not hold the cluster secret, or refused
	// this node's proof.
	RefusedAuth = "auth"
	// RefusedSourceLimit: too many connections not yet authenticated
	// from the peer's source address (MaxPendingPerSource).
	RefusedSourceLimit = "source-limit"
	// RefusedPendingLimit: too many connections not yet authenticated in
	// all (MaxPending), and no other source holds more than the new
	// connection's would; when one does, its oldest is closed instead,
	// and counted under this reason.
	RefusedPendingLimit = "pending-limit"
	// RefusedChannelLimit: too many authenticated channels (MaxChannels).
	RefusedChannelLimit = "channel-limit"
)

// RefusalReasons are the Refused constants.
var RefusalReasons = []string{RefusedClosed, RefusedTimeout, RefusedMalformed, RefusedAuth,
	RefusedSourceLimit, RefusedPendingLimit, RefusedChannelLimit}

// ControlServer serves the control channel: it authenticates peers and
// exposes replicas to them. Connections not yet authenticated are bounded
// per source address and in all, and each has HandshakeTimeout to
// authenticate; one over a bound is closed at once. Refusals are logged
// under a rate limit: the first ones each in a line, then a summary line
// per interval with their counts by reason.
type ControlServer struct {
	// Node is this node's name; Secret the cluster secret.
	Node   string
	Secret Secret
	// Source exposes local replicas.
	Source Source
	// Feeding, if set, is this node's replicas being pulled, which peers
	// may read from as their chunks come in (fan-out, fanout.go).
	Feeding *Feeding
	// Logger receives refusals and errors; nil discards them.
	Logger *slog.Logger
	// MaxPendingPerSource, MaxPending and MaxChannels bound the
	// connections (the Default constants of the same names when 0).
	MaxPendingPerSource, MaxPending, MaxChannels int

	mu       sync.Mutex
	conns    map[net.Conn]*ctlConn
	sources  map[string]int // connections not yet authenticated, by source
	pending  int
	channels int
	refused  map[string]uint64
	wg       sync.WaitGroup

	kvBatches atomic.Uint64
}

// ctlConn is a connection the server holds.
type ctlConn struct {
	source   string
	accepted time.Time
	// pending: counted as not yet authenticated; authed: counted as a
	// channel.
	pending, authed bool
	// evicted: closed to make room for another source's connection
	// (RefusedPendingLimit).
	evicted bool
}

// ControlStats are a control server's connection counts.
type ControlStats struct {
	// Pending counts connections not yet authenticated, Channels the
	// authenticated ones.
	Pending, Channels int
	// Refused counts refused connections by reason (the Refused
	// constants).
	Refused map[string]uint64
	// KVBatches counts the batches of small KV reads served ("kvreads").
	KVBatches uint64
}

// Stats returns the server's connection counts.
func (s *ControlServer) Stats() ControlStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := ControlStats{Pending: s.pending, Channels: s.channels, Refused: map[string]uint64{}, KVBatches: s.kvBatches.Load()}
	for k, v := range s.refused {
		st.Refused[k] = v
	}
	return st
}

// refusalLogBurst and refusalLogEvery bound the log lines refused
// connections cause: that many at once, then one summary per interval
// however many are refused.
const (
	refusalLogBurst = 10
	refusalLogEvery = 5 * time.Second
)

// sourceOf is the key a connection counts under: the remote IPv4
// address, or the /64 of an IPv6 one (what one host is commonly given).
func sourceOf(a net.Addr) string {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return a.String()
	}
	if ip4 := ta.IP.To4(); ip4 != nil {
		return ip4.String()
	}
	return (&net.IPNet{IP: ta.IP.Mask(net.CIDRMask(64, 128)), Mask: net.CIDRMask(64, 128)}).String()
}

func orDefault(v, def int) int {
	if v > 0 {
		return v
	}
	return def
}

// Serve accepts connections on ln until it is closed, then closes every
// connection and returns once their exposures are released.
func (s *ControlServer) Serve(ln net.Listener) error {
	log := s.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	refusals := loglimit.NewRefusals(log, "control: refused connections", refusalLogBurst, refusalLogEvery)
	defer func() {
		s.mu.Lock()
		for c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
		refusals.Close()
	}()
	var backoff time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			// Out of descriptors, or another passing failure: wait a
			// little rather than stop serving peers.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			refusals.Refuse("accept", "-", "control: accepting a connection", "err", err, "retry_in", backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		cc := &ctlConn{source: sourceOf(c.RemoteAddr()), accepted: time.Now()}
		if reason := s.admit(c, cc); reason != "" {
			c.Close()
			s.refuse(refusals, cc, reason, "control: refused a connection", nil)
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serveConn(c, cc, log, refusals)
			s.mu.Lock()
			delete(s.conns, c)
			if cc.authed {
				s.channels--
			}
			s.unpendLocked(cc)
			s.mu.Unlock()
			c.Close()
		}()
	}
}

// admit counts c as a connection not yet authenticated, or says which
// bound refuses it. With all pending places taken, the oldest connection
// of the source holding the most goes instead, when that source holds
// more than c's would: one busy source cannot crowd out the others.
func (s *ControlServer) admit(c net.Conn, cc *ctlConn) (reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conns == nil {
		s.conns, s.sources, s.refused = map[net.Conn]*ctlConn{}, map[string]int{}, map[string]uint64{}
	}
	if s.sources[cc.source] >= orDefault(s.MaxPendingPerSource, DefaultMaxPendingPerSource) {
		return RefusedSourceLimit
	}
	if s.pending >= orDefault(s.MaxPending, DefaultMaxPending) {
		var top string
		for src, n := range s.sources {
			if top == "" || n > s.sources[top] {
				top = src
			}
		}
		if s.sources[top] <= s.sources[cc.source]+1 {
			return RefusedPendingLimit
		}
		var oldest net.Conn
		for o, oc := range s.conns {
			if oc.pending && oc.source == top && (oldest == nil || oc.accepted.Before(s.conns[oldest].accepted)) {
				oldest = o
			}
		}
		if oldest == nil {
			return RefusedPendingLimit
		}
		// Its handshake fails and its goroutine uncounts it.
		s.conns[oldest].evicted = true
		s.unpendLocked(s.conns[oldest])
		oldest.Close()
	}
	s.conns[c] = cc
	cc.pending = true
	s.sources[cc.source]++
	s.pending++
	return ""
}

// unpendLocked uncounts cc as not yet authenticated, once.
func (s *ControlServer) unpendLocked(cc *ctlConn) {
	if !cc.pending {
		return
	}
	cc.pending = false
	if s.sources[cc.source]--; s.sources[cc.source] <= 0 {
		delete(s.sources, cc.source)
	}
	s.pending--
}

// refuse counts a refusal and logs it under the rate limit.
func (s *ControlServer) refuse(r *loglimit.Refusals, cc *ctlConn, reason, msg string, err error) {
	s.mu.Lock()
	s.refused[reason]++
	s.mu.Unlock()
	var args []any
	if err != nil {
		args = append(args, "err", err)
	}
	r.Refuse(reason, cc.source, msg, args...)
}

// handshakeRefusal is the reason a handshake failed with err.
func handshakeRefusal(err error) string {
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout():
		return RefusedTimeout
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed), errors.Is(err, syscall.ECONNRESET):
		return RefusedClosed
	case errors.Is(err, ErrAuth):
		return RefusedAuth
	default:
		return RefusedMalformed
	}
}

func (s *ControlServer) serveConn(c net.Conn, cc *ctlConn, log *slog.Logger, refusals *loglimit.Refusals) {
	_ = c.SetDeadline(cc.accepted.Add(HandshakeTimeout))
	ch, err := serverHandshake(c, s.Secret, s.Node)
	var reason string
	s.mu.Lock()
	switch {
	case cc.evicted:
		reason = RefusedPendingLimit
	case err != nil:
		reason = handshakeRefusal(err)
	case s.channels >= orDefault(s.MaxChannels, DefaultMaxChannels):
		reason, err = RefusedChannelLimit, fmt.Errorf("peer %s: %d authenticated channels already", ch.peer, s.channels)
	default:
		s.unpendLocked(cc)
		cc.authed = true
		s.channels++
	}
	s.mu.Unlock()
	if reason != "" {
		s.refuse(refusals, cc, reason, "control: refused a peer", err)
		return
	}
	_ = c.SetDeadline(time.Time{})
	sc := &servedConn{s: s, ch: ch, log: log.With("peer", ch.peer), slots: make(chan struct{}, MaxInFlight), work: make(chan ctlWork)}
	sc.serve()
}

// servedConn is an authenticated channel a ControlServer serves: one
// goroutine reads its requests and hands each to a worker, at most
// MaxInFlight under way; workers wait a little for the next before they
// end, so that a busy channel does not start a goroutine a request.
type servedConn struct {
	s     *ControlServer
	ch    *channel
	log   *slog.Logger
	held  exposures
	slots chan struct{} // a place per request under way
	work  chan ctlWork  // to an idle worker
	wg    sync.WaitGroup
}

// ctlWork is a request read, with the frame that came after it (Inline).
type ctlWork struct {
	req ctlRequest
	in  []byte
}

// workerIdle is how long a worker of a channel waits for another request
// before it ends.
const workerIdle = time.Second

// serve reads requests until the channel ends, then waits for those under
// way and releases the channel's exposures.
func (sc *servedConn) serve() {
	defer func() {
		close(sc.work)
		sc.wg.Wait()
		sc.held.releaseAll()
	}()
	for {
		var w ctlWork
		if err := sc.ch.read(&w.req); err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				sc.log.Warn("control: dropping the connection", "err", err)
			}
			return
		}
		if n := w.req.Inline; n != 0 {
			if n < 0 || n > maxPoolRaw {
				sc.log.Warn("control: dropping the connection", "err", fmt.Sprintf("a request announcing a frame of %d bytes after it", n))
				return
			}
			var err error
			if w.in, err = sc.ch.readRaw(); err != nil || int64(len(w.in)) != n {
				sc.log.Warn("control: dropping the connection", "err", err, "frame", len(w.in), "announced", n)
				return
			}
		}
		sc.slots <- struct{}{}
		select {
		case sc.work <- w:
		default:
			sc.wg.Add(1)
			go sc.worker(w)
		}
	}
}

// worker serves req, then the requests handed to it, until none comes
// within workerIdle or the channel ends.
func (sc *servedConn) worker(w ctlWork) {
	defer sc.wg.Done()
	idle := time.NewTimer(workerIdle)
	defer idle.Stop()
	var scratch []byte // the small reads' bytes, sealed (copied) by send
	for {
		resp, raw := sc.handle(w.req, w.in, scratch[:0])
		resp.Tag = w.req.Tag
		if err := sc.ch.send(&resp, raw, time.Time{}); err != nil {
			sc.ch.c.Close() // the reader ends
		}
		if (w.req.Op == "kvread" || w.req.Op == "kvreads") && cap(raw) <= 2*maxGatherBatchBytes {
			scratch = raw[:0]
		}
		<-sc.slots
		idle.Reset(workerIdle)
		select {
		case next, ok := <-sc.work:
			if !ok {
				return
			}
			w = next
		case <-idle.C:
			return
		}
	}
}

// handle serves one request, and in, the frame after it; the bytes of
// small reads ("kvread", "kvreads") it appends to scratch.
func (sc *servedConn) handle(req ctlRequest, in, scratch []byte) (resp ctlResponse, raw []byte) {
	s, held := sc.s, &sc.held
	switch req.Op {
	case "read":
		return s.serveRead(req)
	case "open":
		if !held.reserve() {
			resp.Err = fmt.Sprintf("more than %d objects exposed on one connection", MaxExposures)
			break
		}
		e, rel, err := s.Source.Expose(req.Ref, req.ID)
		if err != nil {
			held.unreserve()
			resp.Err, resp.NotHeld = err.Error(), errors.Is(err, ErrNotFound)
			break
		}
		resp.Handle, resp.Exposure = held.add(rel), e
		sc.log.Debug("control: exposed", "object", req.Ref.String(), "size", e.Size)
	case "feed":
		resp = s.serveFeed(req, held)
	case "kvopen":
		resp = s.serveSpace(req, held)
	case "kvread":
		resp, raw = s.serveSpaceRead(req, scratch)
		if resp.Inline == 0 {
			raw = nil
		}
		return resp, raw
	case "kvreads":
		return s.serveSpaceReads(req, scratch)
	case "kvnotify":
		resp = s.serveSpaceNotify(req)
	case "poollookup", "poolpresent", "poolget", "poolput", "pooldelete":
		return s.servePool(req, in, sc.ch.peer, held)
	case "have":
		resp = s.serveHave(req)
	case "close":
		held.release(req.Handle)
	default:
		resp.Err = fmt.Sprintf("unknown control op %q", req.Op)
	}
	return resp, nil
}

// exposures are what one channel holds exposed, by handle: at most
// MaxExposures, counting those being made.
type exposures struct {
	mu       sync.Mutex
	m        map[uint64]func()
	next     uint64
	reserved int
	done     bool
}

// reserve takes a place for one more exposure, false when there is none.
func (x *exposures) reserve() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	if len(x.m)+x.reserved >= MaxExposures {
		return false
	}
	x.reserved++
	return true
}

func (x *exposures) unreserve() {
	x.mu.Lock()
	x.reserved--
	x.mu.Unlock()
}

// add holds rel in a reserved place and returns its handle; once the
// channel is done, it releases rel at once.
func (x *exposures) add(rel func()) uint64 {
	x.mu.Lock()
	x.reserved--
	if x.done {
		x.mu.Unlock()
		rel()
		return 0
	}
	if x.m == nil {
		x.m = map[uint64]func(){}
	}
	x.next++
	h := x.next
	x.m[h] = rel
	x.mu.Unlock()
	return h
}

// release releases the exposure of handle h, if held.
func (x *exposures) release(h uint64) {
	x.mu.Lock()
	rel := x.m[h]
	delete(x.m, h)
	x.mu.Unlock()
	if rel != nil {
		rel()
	}
}

// releaseAll releases every exposure: the channel ended.
func (x *exposures) releaseAll() {
	x.mu.Lock()
	m := x.m
	x.m, x.done = nil, true
	x.mu.Unlock()
	for _, rel := range m {
		rel()
	}
}

// ControlClient is an authenticated control connection to one node. Its
// methods are safe for concurrent use: up to MaxInFlight requests are
// under way at once, each answered as the node finishes it; more wait
// for a place.
type ControlClient struct {
	ch    *channel
	slots chan struct{} // a place per request under way
	done  chan struct{} // closed when the reader ends

	mu      sync.Mutex
	pending map[uint64]*ctlCall
	tag     uint64
	err     error // why the channel broke: every call fails with it
}

// ctlCall is a request under way.
type ctlCall struct {
	raw bool // its answer may carry bytes (Inline)
	// slot: it holds a place (a detached release does not).
	slot bool
	// abandoned: its caller gave up; the reader lets its answer go
	// (releasing an exposure it made). Under ControlClient.mu.
	abandoned bool
	answer    chan ctlAnswer // one answer, or the channel's failure
}

type ctlAnswer struct {
	resp ctlResponse
	raw  []byte
	err  error
}

// DialControl connects to node's control address and authenticates both
// ways, bounded by ctx and HandshakeTimeout. An error wraps ErrAuth when
// either side does not hold the secret.
func DialControl(ctx context.Context, s Secret, self, node, addr string) (*ControlClient, error) {
	if !s.Valid() {
		return nil, fmt.Errorf("%w: no secret", ErrSecret)
	}
	var d net.Dialer
	ctx, cancel := context.WithTimeout(ctx, HandshakeTimeout)
	defer cancel()
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("control channel to node %s at %s: %w", node, addr, err)
	}
	dl, _ := ctx.Deadline()
	_ = c.SetDeadline(dl)
	ch, err := clientHandshake(c, s, self, node)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("control channel to node %s at %s: %w", node, addr, err)
	}
	_ = c.SetDeadline(time.Time{})
	return newControlClient(ch), nil
}

// newControlClient starts the client of an authenticated channel.
func newControlClient(ch *channel) *ControlClient {
	cc := &ControlClient{ch: ch, slots: make(chan struct{}, MaxInFlight), done: make(chan struct{}), pending: map[uint64]*ctlCall{}}
	go cc.read()
	return cc
}

// Open asks the node to expose its replica of ref, incarnation id, and
// returns where to read it and a handle for Release. The node keeps the
// replica until Release or until this connection closes.
func (cc *ControlClient) Open(ctx context.Context, ref Ref, id string) (Exposure, uint64, error) {
	resp, err := cc.roundTrip(ctx, ctlRequest{Op: "open", Ref: ref, ID: id})
	if err != nil {
		return Exposure{}, 0, err
	}
	if resp.Err != "" {
		if resp.NotHeld {
			return Exposure{}, 0, fmt.Errorf("node %s: %w: %s", cc.ch.peer, ErrNotFound, resp.Err)
		}
		return Exposure{}, 0, fmt.Errorf("node %s: %s", cc.ch.peer, resp.Err)
	}
	if err := resp.Exposure.validate(); err != nil {
		return Exposure{}, 0, fmt.Errorf("node %s: %w", cc.ch.peer, err)
	}
	return resp.Exposure, resp.Handle, nil
}

// Release lets the node drop an exposure.
func (cc *ControlClient) Release(ctx context.Context, handle uint64) error {
	_, err := cc.roundTrip(ctx, ctlRequest{Op: "close", Handle: handle})
	return err
}

// errChannel marks a request that got no answer: the channel is broken
// (the peer died, restarted or dropped it), or the answer did not come
// within the request's deadline.
var errChannel = errors.New("no answer")

func (cc *ControlClient) roundTrip(ctx context.Context, req ctlRequest) (ctlResponse, error) {
	return cc.exchange(ctx, req, nil)
}

// exchange sends req and waits for its answer and, when the answer says
// bytes follow (Inline), their frame into *raw; with raw nil, such an
// answer breaks the channel. When ctx ends first, exchange returns its
// error, wrapping errChannel if its deadline passed: the caller drops the
// channel, as one whose node stalled (a request canceled leaves it be).
func (cc *ControlClient) exchange(ctx context.Context, req ctlRequest, raw *[]byte) (ctlResponse, error) {
	return cc.exchangeRaw(ctx, req, nil, raw)
}

// exchangeRaw is exchange with out, when not nil, sent as a frame after
// the request (whose Inline must say its length).
func (cc *ControlClient) exchangeRaw(ctx context.Context, req ctlRequest, out []byte, raw *[]byte) (ctlResponse, error) {
	fail := func(err error) (ctlResponse, error) {
		return ctlResponse{}, fmt.Errorf("control channel to node %s: %w: %w", cc.ch.peer, errChannel, err)
	}
	select {
	case cc.slots <- struct{}{}:
	case <-ctx.Done():
		// Waiting for a place says nothing of the node.
		return ctlResponse{}, fmt.Errorf("control channel to node %s: %w", cc.ch.peer, ctx.Err())
	case <-cc.done:
		return fail(cc.broken())
	}
	call := &ctlCall{raw: raw != nil, slot: true, answer: make(chan ctlAnswer, 1)}
	cc.mu.Lock()
	if cc.err != nil {
		err := cc.err
		cc.mu.Unlock()
		<-cc.slots
		return fail(err)
	}
	cc.tag++
	req.Tag = cc.tag
	cc.pending[req.Tag] = call
	cc.mu.Unlock()
	dl, _ := ctx.Deadline()
	if err := cc.ch.send(&req, out, dl); err != nil {
		cc.fail(err)
	}
	select {
	case a := <-call.answer:
		<-cc.slots
		if a.err != nil {
			return fail(a.err)
		}
		if raw != nil {
			*raw = a.raw
		}
		return a.resp, nil
	case <-ctx.Done():
		cc.mu.Lock()
		if cc.pending[req.Tag] == call {
			call.abandoned = true // the reader releases the place
			cc.mu.Unlock()
			return cc.ended(ctx)
		}
		cc.mu.Unlock()
		a := <-call.answer // on its way
		<-cc.slots
		cc.drop(a.resp)
		return cc.ended(ctx)
	}
}

// ended is the error of a request whose ctx ended before its answer.
func (cc *ControlClient) ended(ctx context.Context) (ctlResponse, error) {
	err := ctx.Err()
	if errors.Is(err, context.DeadlineExceeded) {
		return ctlResponse{}, fmt.Errorf("control channel to node %s: %w: %w", cc.ch.peer, errChannel, err)
	}
	return ctlResponse{}, fmt.Errorf("control channel to node %s: %w", cc.ch.peer, err)
}

// drop lets go of the answer of a request whose caller gave up: an
// exposure it made is released (a request of its own, not waited for).
func (cc *ControlClient) drop(resp ctlResponse) {
	if resp.Err != "" || resp.Handle == 0 {
		return
	}
	go func() {
		call := &ctlCall{abandoned: true}
		cc.mu.Lock()
		if cc.err != nil {
			cc.mu.Unlock()
			return // the node releases it with the channel
		}
		cc.tag++
		req := ctlRequest{Tag: cc.tag, Op: "close", Handle: resp.Handle}
		cc.pending[req.Tag] = call
		cc.mu.Unlock()
		if err := cc.ch.send(&req, nil, time.Now().Add(HandshakeTimeout)); err != nil {
			cc.fail(err)
		}
	}()
}

// read reads the answers and hands each to its request, until the channel
// breaks; then every request under way fails.
func (cc *ControlClient) read() {
	defer close(cc.done)
	for {
		p, err := cc.ch.readRaw()
		if err != nil {
			cc.fail(err)
			return
		}
		var resp ctlResponse
		if err := decodeStrict(p, &resp); err != nil {
			cc.fail(err)
			return
		}
		var raw []byte
		if resp.Inline != 0 {
			if resp.Inline < 0 || resp.Inline > maxGatherBatchBytes {
				cc.fail(fmt.Errorf("%w: %d inline bytes", ErrBadRecord, resp.Inline))
				return
			}
			if raw, err = cc.ch.readRaw(); err != nil {
				cc.fail(err)
				return
			}
		}
		cc.mu.Lock()
		call := cc.pending[resp.Tag]
		delete(cc.pending, resp.Tag)
		abandoned := call != nil && call.abandoned
		cc.mu.Unlock()
		switch {
		case call == nil:
			cc.fail(fmt.Errorf("%w: an answer to no request (tag %d)", ErrBadRecord, resp.Tag))
			return
		case resp.Inline != 0 && !call.raw:
			// Out of step with the peer: the channel is never used again.
			err := fmt.Errorf("%w: %d inline bytes unasked", ErrBadRecord, resp.Inline)
			cc.fail(err)
			if !abandoned {
				call.answer <- ctlAnswer{err: err}
			} else if call.slot {
				<-cc.slots
			}
			return
		case abandoned:
			if call.slot {
				<-cc.slots
			}
			cc.drop(resp)
		default:
			call.answer <- ctlAnswer{resp: resp, raw: raw}
		}
	}
}

// fail breaks the channel with err, once: its connection is closed and
// every request under way fails.
func (cc *ControlClient) fail(err error) {
	cc.mu.Lock()
	if cc.err == nil {
		cc.err = err
	}
	calls := cc.pending
	cc.pending = map[uint64]*ctlCall{}
	cc.mu.Unlock()
	cc.ch.c.Close()
	for _, call := range calls {
		switch {
		case !call.abandoned:
			call.answer <- ctlAnswer{err: err}
		case call.slot:
			<-cc.slots
		}
	}
}

// broken is why the channel broke.
func (cc *ControlClient) broken() error {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	return cc.err
}

// Peer is the authenticated name of the node at the other end.
func (cc *ControlClient) Peer() string { return cc.ch.peer }

// Close closes the connection; the node releases every exposure of it,
// and requests under way fail.
func (cc *ControlClient) Close() error { return cc.ch.c.Close() }
