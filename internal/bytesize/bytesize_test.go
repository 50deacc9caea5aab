package bytesize

import "testing"

func TestParse(t *testing.T) {
	for in, want := range map[string]int64{"4096": 4096, "4KiB": 4096, "64k": 64 << 10, "16MiB": 16 << 20, "1G": 1 << 30, "2 GiB": 2 << 30, "0": 0, "3tb": 3 << 40} {
		if got, err := Parse(in); err != nil || got != want {
			t.Errorf("Parse(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-1", "1.5G", "MiB", "12XB", "9999999999999T"} {
		if _, err := Parse(in); err == nil {
			t.Errorf("Parse(%q) accepted", in)
		}
	}
	var s Size
	if err := s.UnmarshalText([]byte("64KiB")); err != nil || s != 64<<10 || s.String() != "64 KiB" {
		t.Errorf("Size: %d %q %v", s, s, err)
	}
}

func TestFormat(t *testing.T) {
	for n, want := range map[int64]string{
		0: "0 B", 1000: "1000 B", 1 << 10: "1 KiB", 1 << 30: "1 GiB", 4 << 30: "4 GiB", 1 << 20: "1 MiB",
		1536 << 10: "1.5 MiB", 300<<10 + 17: "300.0 KiB", 64 << 20: "64 MiB", 3 << 40: "3 TiB", 5 << 50: "5 PiB", 1<<62 + 1<<49: "4096.5 PiB",
	} {
		if got := Format(n); got != want {
			t.Errorf("Format(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestMarshalText(t *testing.T) {
	for n, want := range map[int64]string{0: "0", 4097: "4097", 1 << 10: "1KiB", 1536 << 10: "1536KiB", 1 << 30: "1GiB", 3 << 40: "3TiB", 5 << 50: "5120TiB"} {
		text, err := Size(n).MarshalText()
		if err != nil || string(text) != want {
			t.Errorf("Size(%d).MarshalText() = %q, %v; want %q", n, text, err, want)
		}
		var back Size
		if err := back.UnmarshalText(text); err != nil || int64(back) != n {
			t.Errorf("UnmarshalText(%q) = %d, %v; want %d", text, back, err, n)
		}
	}
}
