package protocol

import (
	"encoding/binary"
	"encoding/hex"
	"flag"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// The vectors in testdata/leaseslot and testdata/framing are the lease slot
// words and the packets of the requests the Python client encodes by hand
// (get and release, its hot path), as files that the Python client's tests
// (python/tests/test_vectors.py) check its own implementation against.
// go test -run 'LeaseSlotVectors|FramingVectors' -update rewrites them from
// the code.
var update = flag.Bool("update", false, "rewrite testdata/leaseslot and testdata/framing from the code")

// slotBytes is a slot word as it lies in the lease table (little-endian,
// as on every host the daemon runs on), in hex.
func slotBytes(w uint64) string {
	return hex.EncodeToString(binary.LittleEndian.AppendUint64(nil, w))
}

func slotWord(t *testing.T, s string) uint64 {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != 8 {
		t.Fatalf("slot word %q", s)
	}
	return binary.LittleEndian.Uint64(b)
}

type slotWordVector struct {
	Gen  uint64 `json:"gen"`
	Held string `json:"held"`
	Idle string `json:"idle"`
}

// slotSwapVector is a client swap (release: held to idle; retake: idle to
// held) of lease gen in a slot holding word: whether it succeeds, and the
// word the slot holds after it (word itself when it fails).
type slotSwapVector struct {
	Name string `json:"name"`
	Gen  uint64 `json:"gen"`
	Word string `json:"word"`
	OK   bool   `json:"ok"`
	Next string `json:"next"`
}

type leaseSlotVectors struct {
	Comment string           `json:"comment"`
	Words   []slotWordVector `json:"words"`
	Release []slotSwapVector `json:"release"`
	Retake  []slotSwapVector `json:"retake"`
}

func leaseSlotCases() *leaseSlotVectors {
	v := &leaseSlotVectors{Comment: "lease slot words (docs/protocol.md 6.7), each as the 8 bytes in the table, " +
		"written by protocol/vectors_test.go; a swap that fails leaves the word as it was"}
	for _, g := range []uint64{1, 2, 0x123456789, 1 << 40, MaxSlotGen} {
		v.Words = append(v.Words, slotWordVector{g, slotBytes(SlotWord(g, SlotHeld, false)), slotBytes(SlotWord(g, SlotIdle, false))})
	}
	const g = 0x0abcdef1234
	words := []struct {
		name string
		w    uint64
	}{
		{"held", SlotWord(g, SlotHeld, false)},
		{"held, doomed", SlotWord(g, SlotHeld, true)},
		{"idle", SlotWord(g, SlotIdle, false)},
		{"idle, doomed", SlotWord(g, SlotIdle, true)},
		{"free (reclaimed)", SlotWord(g, SlotFree, false)},
		{"held by the next grant", SlotWord(g+1, SlotHeld, false)},
		{"idle of the grant before", SlotWord(g-1, SlotIdle, false)},
		{"state 3", SlotWord(g, 3, false)},
	}
	for _, c := range words {
		next, ok := SlotRelease(c.w, g)
		if !ok {
			next = c.w
		}
		v.Release = append(v.Release, slotSwapVector{c.name, g, slotBytes(c.w), ok, slotBytes(next)})
		old, next := SlotRetake(g)
		ok = c.w == old
		if !ok {
			next = c.w
		}
		v.Retake = append(v.Retake, slotSwapVector{c.name, g, slotBytes(c.w), ok, slotBytes(next)})
	}
	return v
}

func TestLeaseSlotVectors(t *testing.T) {
	var v leaseSlotVectors
	testutil.CheckVectorFile(t, filepath.Join("..", "testdata", "leaseslot", "vectors.json"), *update, leaseSlotCases(), &v)
	for _, c := range v.Words {
		held, idle := slotWord(t, c.Held), slotWord(t, c.Idle)
		if held != SlotWord(c.Gen, SlotHeld, false) || idle != SlotWord(c.Gen, SlotIdle, false) {
			t.Errorf("gen %d: held %#x idle %#x", c.Gen, held, idle)
		}
		for w, st := range map[uint64]SlotState{held: SlotHeld, idle: SlotIdle} {
			if g, s, d := DecodeSlot(w); g != c.Gen || s != st || d {
				t.Errorf("%#x decodes to %d %d %v", w, g, s, d)
			}
		}
	}
	for _, c := range v.Release {
		next, ok := SlotRelease(slotWord(t, c.Word), c.Gen)
		if ok != c.OK || ok && next != slotWord(t, c.Next) {
			t.Errorf("release, %s: %#x %v", c.Name, next, ok)
		}
	}
	for _, c := range v.Retake {
		old, next := SlotRetake(c.Gen)
		if ok := slotWord(t, c.Word) == old; ok != c.OK || ok && next != slotWord(t, c.Next) {
			t.Errorf("retake, %s: %v", c.Name, ok)
		}
	}
}

type getVector struct {
	Name      string `json:"name"`
	TimeoutMs int64  `json:"timeout_ms"`
}

type releaseVector struct {
	LeaseID uint64 `json:"lease_id"`
}

// packetVector is one request packet: exactly one of Get and Release.
type packetVector struct {
	Name    string         `json:"name"`
	ID      uint64         `json:"id"`
	Get     *getVector     `json:"get,omitempty"`
	Release *releaseVector `json:"release,omitempty"`
	Packet  string         `json:"packet"` // hex
}

type badPacketVector struct {
	Name   string `json:"name"`
	Packet string `json:"packet"` // hex
	Error  string `json:"error"`
}

type framingVectors struct {
	Comment        string            `json:"comment"`
	MaxMessageSize int               `json:"max_message_size"`
	MaxFiles       int               `json:"max_files"`
	Requests       []packetVector    `json:"requests"`
	Invalid        []badPacketVector `json:"invalid"`
}

func (p packetVector) request() *storev1.Request {
	r := &storev1.Request{Id: p.ID}
	if p.Get != nil {
		r.Body = &storev1.Request_Get{Get: &storev1.GetRequest{Name: p.Get.Name, TimeoutMs: p.Get.TimeoutMs}}
	} else {
		r.Body = &storev1.Request_Release{Release: &storev1.ReleaseRequest{LeaseId: p.Release.LeaseID}}
	}
	return r
}

func framingCases() *framingVectors {
	v := &framingVectors{Comment: "request packets (docs/protocol.md section 2: one protobuf Request per packet) that the Python client " +
		"encodes by hand, written by protocol/vectors_test.go; error \"malformed\": Go proto.Unmarshal fails, Python DecodeError",
		MaxMessageSize: MaxMessageSize, MaxFiles: MaxFiles}
	long := strings.Repeat("layer.", 30) + "weight"
	for _, p := range []packetVector{
		{Name: "get, no wait", ID: 1, Get: &getVector{"w", 0}},
		{Name: "get, 5 s", ID: 300, Get: &getVector{"model/v12", 5000}},
		{Name: "get, no limit", ID: 1 << 35, Get: &getVector{"ünïcödé", -1}},
		{Name: "get, a long name", ID: 127, Get: &getVector{long, 1 << 40}},
		{Name: "release", ID: 2, Release: &releaseVector{1}},
		{Name: "release, large ids", ID: 1<<64 - 1, Release: &releaseVector{1<<63 + 12345}},
	} {
		b, err := proto.Marshal(p.request())
		if err != nil {
			panic(err)
		}
		p.Packet = hex.EncodeToString(b)
		v.Requests = append(v.Requests, p)
	}
	get, _ := proto.Marshal(&storev1.Request{Id: 7, Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: "abc", TimeoutMs: 9}}})
	for _, c := range []struct {
		name string
		b    []byte
	}{
		{"truncated", get[:len(get)-1]},
		{"body longer than the packet", append(append([]byte{}, get[:2]...), 0x72, 0x40, 0x0a, 0x01, 'a')},
		{"unterminated varint", []byte{0x08, 0xff, 0xff}},
		{"name not UTF-8", []byte{0x08, 0x01, 0x72, 0x03, 0x0a, 0x01, 0xff}},
	} {
		if proto.Unmarshal(c.b, &storev1.Request{}) == nil {
			panic(c.name + ": decoded")
		}
		v.Invalid = append(v.Invalid, badPacketVector{c.name, hex.EncodeToString(c.b), "malformed"})
	}
	return v
}

func TestFramingVectors(t *testing.T) {
	var v framingVectors
	testutil.CheckVectorFile(t, filepath.Join("..", "testdata", "framing", "vectors.json"), *update, framingCases(), &v)
	if v.MaxMessageSize != MaxMessageSize || v.MaxFiles != MaxFiles {
		t.Errorf("limits %d %d", v.MaxMessageSize, v.MaxFiles)
	}
	for _, c := range v.Requests {
		b, err := proto.Marshal(c.request())
		if err != nil || hex.EncodeToString(b) != c.Packet {
			t.Errorf("%s: %x, %v, want %s", c.Name, b, err, c.Packet)
		}
		var got storev1.Request
		pb, _ := hex.DecodeString(c.Packet)
		if err := proto.Unmarshal(pb, &got); err != nil || !proto.Equal(&got, c.request()) {
			t.Errorf("%s: decoded %v, %v", c.Name, &got, err)
		}
	}
	for _, c := range v.Invalid {
		b, _ := hex.DecodeString(c.Packet)
		var got storev1.Request
		if err := proto.Unmarshal(b, &got); err == nil {
			t.Errorf("%s: decoded %v", c.Name, &got)
		}
	}
}
