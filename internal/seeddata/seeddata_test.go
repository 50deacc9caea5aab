package seeddata

import (
	"bytes"
	"testing"
)

func TestFill(t *testing.T) {
	a := Bytes(7, 1<<20+13)
	if !bytes.Equal(a, Bytes(7, len(a))) {
		t.Fatal("one seed made two streams")
	}
	if bytes.Equal(a[:64], Bytes(8, 64)) {
		t.Fatal("two seeds made one stream")
	}
	if zeros := bytes.Count(a, []byte{0}); zeros > len(a)/128 {
		t.Fatalf("%d zero bytes in %d", zeros, len(a))
	}
	if !bytes.Equal(Bytes(7, 10), a[:10]) {
		t.Fatal("a shorter stream is not a prefix of a longer one")
	}
	if Named(1, "a") == Named(1, "b") || Named(1, "a") == Named(2, "a") {
		t.Fatal("Named does not separate names and seeds")
	}
}
