`timescale 1 ps/1 ps

// Stimulus generator: walks through all four input combinations, then
// applies random values on every clock edge.
module stimulus_gen (
  input            clk,
  output reg       a,
  output reg       b
);

  integer seed = 2002;
  integer i;

  initial begin
    {a, b} = 2'b00;
    for (i = 0; i < 4; i = i + 1)
      @(posedge clk, negedge clk) {a, b} <= i[1:0];
    repeat (100) @(posedge clk, negedge clk) {a, b} <= $random(seed);
    #1 $finish;
  end

endmodule

module tb ();

  reg clk = 0;
  initial forever #5 clk = ~clk;

  wire a;
  wire b;
  wire out_ref;
  wire out_dut;

  integer errors = 0;
  integer clocks = 0;
  integer errors_out = 0;
  integer errortime_out = 0;

  stimulus_gen stim1 (
    .clk(clk),
    .a(a),
    .b(b)
  );

  RefModule good1 (
    .a(a),
    .b(b),
    .out(out_ref)
  );

  TopModule top_module1 (
    .a(a),
    .b(b),
    .out(out_dut)
  );

  // Safety net against designs that hang the simulation.
  initial begin #1000000 $display("TIMEOUT"); $finish(); end

  // Bitwise match: a bit matches when it is identical (===) in both designs.
  // A bit that is x in the reference is treated as "don't care".
  wire match_out = (out_ref === (out_ref ^ out_dut ^ out_ref));

  always @(posedge clk, negedge clk) begin
    clocks = clocks + 1;
    if (!match_out) begin
      if (errors_out == 0) errortime_out = $time;
      errors_out = errors_out + 1;
    end
    if (!match_out)
      errors = errors + 1;
  end

  // Runs on every $finish (normal end or timeout).
  final begin
    if (errors_out)
      $display("Hint: Output '%s' has %1d mismatches. First mismatch occurred at time %1d.", "out", errors_out, errortime_out);
    else
      $display("Hint: Output '%s' has no mismatches.", "out");
    $display("Hint: Total mismatched samples is %1d out of %1d samples", errors, clocks);
    $display("Simulation finished at %1d ps", $time);
    $display("Mismatches: %1d in %1d samples", errors, clocks);
  end

endmodule
