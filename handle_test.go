package cudaipc

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func randomHandle(t testing.TB) MemHandle {
	var h MemHandle
	if _, err := rand.Read(h[:]); err != nil {
		t.Fatal(err)
	}
	return h
}

func TestMemHandleEncodings(t *testing.T) {
	h := randomHandle(t)
	text, _ := h.MarshalText()
	if len(text) != 88 {
		t.Fatalf("text is %d chars", len(text))
	}
	var h2 MemHandle
	if err := h2.UnmarshalText(text); err != nil || h2 != h {
		t.Fatalf("text round trip: %v", err)
	}
	bin, _ := h.MarshalBinary()
	var h3 MemHandle
	if err := h3.UnmarshalBinary(bin); err != nil || h3 != h {
		t.Fatalf("binary round trip: %v", err)
	}
	js, err := json.Marshal(struct{ H MemHandle }{h})
	if err != nil {
		t.Fatal(err)
	}
	var back struct{ H MemHandle }
	if err := json.Unmarshal(js, &back); err != nil || back.H != h {
		t.Fatalf("json round trip: %v", err)
	}
	// String is a fingerprint: it must not leak the handle.
	if s := h.String(); strings.Contains(s, string(text[:16])) || !strings.HasPrefix(s, "MemHandle(sha256:") {
		t.Fatalf("String() = %q", s)
	}
}

func TestMemHandleRejectsBadInput(t *testing.T) {
	h := randomHandle(t)
	text, _ := h.MarshalText()
	bad := [][]byte{
		nil, []byte("x"), text[:87], append(append([]byte{}, text...), 'A'), []byte(strings.Repeat("A", 88)[:86] + "!!"),
		[]byte(strings.Repeat("QUFB", 22)), // 66 bytes decoded
		[]byte(strings.Repeat("0", 92)),    // over-long: used to panic inside base64.Decode
		[]byte(strings.Repeat("QUFB", 200)),
	}
	for _, b := range bad {
		var out MemHandle
		if err := out.UnmarshalText(b); err == nil {
			t.Errorf("accepted %q", b)
		} else if out != (MemHandle{}) {
			t.Errorf("rejected %q but modified the handle", b)
		}
	}
	for _, n := range []int{0, 1, 63, 65, 128} {
		var out EventHandle
		if err := out.UnmarshalBinary(make([]byte, n)); err == nil {
			t.Errorf("binary of %d bytes accepted", n)
		}
	}
}

func FuzzMemHandleText(f *testing.F) {
	h := randomHandle(f)
	text, _ := h.MarshalText()
	f.Add(text)
	f.Add([]byte("=="))
	f.Add(bytes.Repeat([]byte("A"), 88))
	f.Fuzz(func(t *testing.T, b []byte) {
		var h MemHandle
		if err := h.UnmarshalText(b); err != nil {
			return
		}
		out, _ := h.MarshalText()
		if !bytes.Equal(out, b) {
			t.Fatalf("accepted non-canonical %q (canonical %q)", b, out)
		}
		var e EventHandle
		if err := e.UnmarshalText(b); err != nil || [64]byte(e) != [64]byte(h) {
			t.Fatalf("event handle decodes differently: %v", err)
		}
	})
}

func TestUUIDText(t *testing.T) {
	var u UUID
	copy(u[:], []byte{0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
	s := u.String()
	if s != "GPU-deadbeef-0102-0304-0506-0708090a0b0c" {
		t.Fatalf("String() = %s", s)
	}
	for _, in := range []string{s, strings.TrimPrefix(s, "GPU-"), strings.ToUpper(s[4:])} {
		v, err := ParseUUID(in)
		if err != nil || v != u {
			t.Errorf("ParseUUID(%q) = %v, %v", in, v, err)
		}
	}
	for _, in := range []string{"", "GPU-", "GPU-deadbeef", s + "00", "GPU-zzadbeef-0102-0304-0506-0708090a0b0c"} {
		if _, err := ParseUUID(in); err == nil {
			t.Errorf("ParseUUID(%q) accepted", in)
		}
	}
}

func TestParseDeviceSelector(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want DeviceSelector
	}{
		{"0", DeviceSelector{Ordinal: 0}},
		{"3", DeviceSelector{Ordinal: 3}},
		{"GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8", DeviceSelector{IsUUID: true, UUID: UUID{0x5f, 0x1c, 0x2a, 0x3b, 0x4d, 0x5e, 0x6f, 0x70, 0x81, 0x92, 0xa3, 0xb4, 0xc5, 0xd6, 0xe7, 0xf8}}},
		{"5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8", DeviceSelector{IsUUID: true, UUID: UUID{0x5f, 0x1c, 0x2a, 0x3b, 0x4d, 0x5e, 0x6f, 0x70, 0x81, 0x92, 0xa3, 0xb4, 0xc5, 0xd6, 0xe7, 0xf8}}},
	} {
		got, err := ParseDeviceSelector(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("%q: %+v %v", tc.in, got, err)
		}
		if back, err := ParseDeviceSelector(got.String()); err != nil || back != got {
			t.Errorf("%q: String %q does not parse back", tc.in, got.String())
		}
	}
	for _, bad := range []string{"", "-1", "gpu0", "GPU-zz", "host", "1.5"} {
		_, err := ParseDeviceSelector(bad)
		var ae *ArgError
		if !errors.As(err, &ae) || !strings.Contains(err.Error(), "ordinal") || !strings.Contains(err.Error(), "UUID") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}
