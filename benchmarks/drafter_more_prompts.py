"""More training prompts for the SmolLM2 drafter (issue 56): templates x topics, written for this
purpose, rendered in a fixed order into `drafter_prompts_more.json` (a `train` list only).

    python benchmarks/drafter_more_prompts.py [--set 1|2] [--out FILE]

`--set 1` (the default) renders KINDS into `drafter_prompts_more.json`; `--set 2` renders KINDS_2
(other templates and topics) into `drafter_prompts_more2.json`, dropping any prompt set 1 holds.

The held-out prompts of `drafter_prompts.json` stay what they are and are never trained on: a
generated prompt is dropped when it equals a prompt of either shipped split, or when its content
words overlap a held-out prompt's by Jaccard >= 0.5 (so "the same question reworded" never
enters training; the same kind of task on another topic does, as in the shipped train split).
The kinds of task follow the shipped prompts: explanations, history, computing and code,
creative writing, messages, advice, recipes, arithmetic, comparisons, summaries, facts,
rewriting, lists, word meanings, ideas, how-to, jobs, descriptions, reasons and game rules.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "drafter_prompts_more.json"
OUT2 = HERE / "drafter_prompts_more2.json"  # `--set 2`: KINDS_2, none of OUT's prompts repeated

# (template, fillers): every filler through the template, in this order.
KINDS: list[tuple[str, list[str]]] = [
    ("Explain how {} works.", [
        "a microwave oven", "a bicycle gear", "a camera", "a thermometer", "an elevator", "a hot air balloon",
        "a submarine", "a washing machine", "a battery", "a light bulb", "a telescope", "a microscope",
        "a wind turbine", "a jet engine", "a pendulum clock", "a vending machine", "a lock and key",
        "a parachute", "a solar eclipse", "the stock market", "a credit card", "a library catalog",
        "a traffic light", "a dishwasher", "a smoke detector", "a barcode scanner", "a thermostat",
        "an electric guitar", "a 3D printer", "a hydroelectric dam"]),
    ("Why do {}?", [
        "birds sing in the morning", "dogs wag their tails", "we yawn", "our ears pop on airplanes",
        "we get goosebumps", "some animals hibernate", "fireflies glow", "we dream", "tides rise and fall",
        "bread rise", "apples turn brown after cutting", "our fingers wrinkle in water", "owls hunt at night",
        "people get hiccups", "zebras have stripes", "metals feel cold", "we sneeze", "cats land on their feet",
        "deserts get cold at night", "mosquitoes bite", "flowers smell sweet", "we shiver when cold",
        "giraffes have long necks", "planes leave white trails in the sky"]),
    ("What is {} and why does it matter?", [
        "biodiversity", "inflation", "friction", "evaporation", "the ozone layer", "a carbon footprint",
        "pollination", "a healthy diet", "compound interest", "soil", "recycling", "the immune system",
        "a vaccine", "a calendar", "voting", "the scientific method", "literacy", "clean drinking water",
        "a good night's sleep", "teamwork"]),
    ("Explain {} in simple terms.", [
        "how rain forms", "what an ecosystem is", "how a seed grows into a plant", "what energy is",
        "how the stomach digests food", "what a galaxy is", "how lungs work", "what a molecule is",
        "what a fossil is", "how wind is made", "what evolution means", "how a river forms",
        "what a cell is", "how fish breathe", "what static electricity is", "how muscles grow",
        "what a comet is", "how thunder happens", "what a habitat is", "how glaciers move"]),
    ("Who was {}?", [
        "Albert Einstein", "Cleopatra", "Napoleon Bonaparte", "Mahatma Gandhi", "Abraham Lincoln",
        "Galileo Galilei", "Queen Victoria", "Charles Darwin", "Nelson Mandela", "Florence Nightingale",
        "Genghis Khan", "Wolfgang Amadeus Mozart", "Joan of Arc", "Christopher Columbus", "Ada Lovelace",
        "Thomas Edison", "Frida Kahlo", "Alexander the Great", "Jane Austen", "Martin Luther King Jr.",
        "Amelia Earhart", "Nikola Tesla", "Confucius", "William the Conqueror", "Rosa Parks"]),
    ("Tell me about {}.", [
        "the ancient Romans", "the history of the telephone", "the Aztec empire", "the invention of paper",
        "the French Revolution", "the history of the train", "ancient China", "the Titanic",
        "the Wright brothers' first flight", "the history of the radio", "the Inca people",
        "the Ottoman Empire", "the history of money", "the Cold War", "the Stone Age", "the Bronze Age",
        "the history of the airplane", "the building of the Eiffel Tower", "the gold rush in California",
        "the history of tea", "the history of the piano", "ancient Mesopotamia", "the Mayan calendar"]),
    ("What was {}?", [
        "the Black Death", "the American Revolution", "the Space Race", "the Great Depression",
        "the Ice Age", "the Age of Exploration", "the Reformation", "the Berlin Wall",
        "the Boston Tea Party", "the printing revolution", "the Hundred Years' War", "the Enlightenment",
        "the Trojan War", "the Byzantine Empire", "the Meiji Restoration"]),
    ("What is {}?", [
        "a web browser", "a computer virus", "artificial intelligence", "a spreadsheet", "a file system",
        "a compiler", "an IP address", "a router", "a server", "a smartphone app", "a cookie on a website",
        "two-factor authentication", "a programming language", "a keyboard shortcut", "a pdf file",
        "a URL", "a firewall", "a cache", "a processor", "a hard drive", "version control",
        "an API", "a bug in software", "a pixel art", "a QR code", "Bluetooth", "a modem", "a chatbot",
        "a video game engine", "a blockchain"]),
    ("Write a Python function that {}.", [
        "returns the sum of a list", "checks whether a word is a palindrome", "counts the words in a sentence",
        "finds the smallest number in a list", "returns the even numbers of a list", "converts a string to uppercase",
        "merges two lists", "returns the last element of a list", "computes the area of a circle",
        "checks whether a year is a leap year", "returns the length of the longest word in a sentence",
        "squares every number in a list", "capitalizes every word in a sentence", "counts how often a letter appears",
        "returns the nth Fibonacci number", "checks whether a list is sorted", "removes the spaces from a string",
        "returns the average of three numbers", "converts minutes to hours and minutes",
        "finds the second largest number in a list"]),
    ("How do I {} in Python?", [
        "read a CSV file", "join a list of strings", "get the current date", "generate a random number",
        "split a string into words", "loop over a dictionary", "check if a key is in a dictionary",
        "write to a text file", "handle an exception", "import a module", "make a class", "round a number",
        "reverse a list", "find the index of an item in a list", "install a package with pip",
        "format a string with a variable", "convert a string to an integer", "use a while loop"]),
    ("What is {} in programming?", [
        "a function", "a loop", "a string", "an array", "a boolean", "an object", "a class", "a bug",
        "debugging", "a library", "a syntax error", "an integer", "a return value", "a parameter",
        "a comment", "an index", "a constant", "a stack"]),
    ("Write a short poem about {}.", [
        "the moon", "a quiet river", "a rainy afternoon", "a lighthouse", "a garden in summer", "the mountains",
        "an old oak tree", "a sleeping cat", "the wind", "a summer storm", "a childhood memory", "a busy train station",
        "the sunrise", "a field of sunflowers", "the desert at night", "a butterfly", "a winter morning",
        "the sea breeze"]),
    ("Write a haiku about {}.", [
        "the ocean", "a frog in a pond", "spring rain", "a mountain lake", "cherry blossoms", "the city at dawn",
        "a snowflake", "a candle", "the summer heat", "a crow on a fence"]),
    ("Write a short story about {}.", [
        "a boy who finds a magic key", "a cat who becomes a detective", "a lonely lighthouse keeper",
        "a talking teapot", "two friends lost in a cave", "a baker who bakes a giant cake",
        "a dog who wants to fly", "a robot who makes a friend", "a girl who plants a magic seed",
        "a mouse who lives in a library", "a knight who is afraid of the dark", "a fox who learns to share",
        "a child who discovers a secret garden", "an astronaut who finds a new planet", "a shy giant",
        "a bear who opens a bakery", "a pirate who hates the sea", "a grandmother who can time travel",
        "a snowman who wants to see summer", "a little boat in a big storm"]),
    ("Write a {}.", [
        "short speech for a school graduation", "thank-you note to a neighbor who helped me move",
        "short review of a pizza restaurant", "product description for a pair of running shoes",
        "short advertisement for a bookshop", "welcome message for a new coworker",
        "product description for a wooden desk lamp", "short bio for a freelance photographer",
        "message to congratulate a friend on a new baby", "get-well-soon card for a coworker",
        "short announcement that the office will be closed on Monday", "product description for a backpack",
        "polite complaint about a late delivery", "short toast for a retirement party",
        "text message inviting friends to a board game night", "short description of a yoga class",
        "short post announcing a community clean-up day", "welcome message for a book club",
        "short note asking a roommate to do the dishes", "product description for a scented candle",
        "short menu description for a vegetable curry", "reminder email about a dentist appointment",
        "short slogan for a bike shop", "letter to a pen pal in another country",
        "short introduction of myself for a new class", "birthday message for my sister"]),
    ("How can I {}?", [
        "save time when cooking", "stop procrastinating", "learn to swim as an adult", "keep my desk tidy",
        "stay calm in traffic", "eat more vegetables", "get better at drawing", "remember names better",
        "spend less time on my phone", "be a better listener", "make my mornings less rushed",
        "stay warm in winter", "learn to type faster", "make my home more energy efficient",
        "get more exercise at work", "make a good first impression", "keep my plants from dying while on holiday",
        "write clearer emails", "read more books", "stay motivated to learn"]),
    ("Give me {}.", [
        "five tips for a long car trip", "a recipe for a simple omelette", "three ideas for a family dinner",
        "a simple workout I can do at home", "five tips for saving electricity", "a recipe for banana bread",
        "a packing list for a beach holiday", "three tips for a first day at school", "a recipe for a fruit salad",
        "five ideas for a birthday present", "a simple plan for cleaning the kitchen",
        "three easy dinner ideas for busy evenings", "a recipe for homemade lemonade",
        "five tips for taking better photos with a phone", "three ways to relax after work",
        "a short list of things to do before a flight", "a recipe for guacamole", "ideas for a picnic lunch",
        "tips for keeping a car clean", "a simple recipe for fried rice"]),
    ("How do I make {}?", [
        "a grilled cheese sandwich", "mashed potatoes", "a green salad", "hot chocolate", "scrambled eggs",
        "popcorn on the stove", "a paper boat", "a bird feeder", "iced tea", "a simple pizza at home",
        "french toast", "a kite", "homemade soap", "a cup of coffee with a french press", "oatmeal"]),
    ("What is {}?", [
        "25 percent of 80", "10 percent of 350", "7 times 8", "half of 96", "the square of 9",
        "the average of 4, 8 and 12", "one third of 27", "the cube of 3", "100 divided by 4",
        "a quarter of 60", "20 percent of 150", "the sum of the numbers from 1 to 10"]),
    ("{}", [
        "If a pizza has 8 slices and I eat 3, how many are left?",
        "A car travels 50 miles per hour. How far does it go in 4 hours?",
        "What is the area of a circle with a radius of 3 centimeters?", "How many seconds are in an hour?",
        "Solve for x: 3x - 4 = 11.", "If a book costs 12 dollars and I buy 4, how much do I pay?",
        "How do you convert kilometers to miles?", "How do you find the perimeter of a rectangle?",
        "What is the difference between a square and a rectangle?", "How do you multiply fractions?",
        "Explain what a ratio is.", "How many weeks are in a year?", "What is an even number?",
        "How do you calculate a tip of 15 percent?", "What is the volume of a cube with sides of 2 meters?",
        "Explain long division with an example.", "What is a decimal number?",
        "How do you round 3.67 to one decimal place?",
        "If I read 20 pages a day, how long will a 300-page book take?", "How many hours are in a week?"]),
    ("What is the difference between {}?", [
        "a star and a planet", "a hurricane and a tornado", "a moth and a butterfly", "a rabbit and a hare",
        "a mountain and a hill", "baking and roasting", "a city and a town", "a poem and a song",
        "a doctor and a nurse", "a dolphin and a shark", "a fruit and a vegetable", "a desert and a jungle",
        "a river and a stream", "a virus and a cold", "a museum and a gallery", "speed and velocity",
        "a noun and a verb", "an island and a peninsula", "a bee and a wasp", "a violin and a cello",
        "a laptop and a tablet", "a whale and a fish"]),
    ("Compare {}.", [
        "bicycles and cars for getting around a city", "summer and winter holidays", "paper books and e-books",
        "working from home and working in an office", "apples and oranges as snacks",
        "living alone and living with roommates",
        "the violin and the piano", "buses and trains", "learning online and learning in a classroom",
        "swimming and running as exercise", "mountains and beaches for a holiday", "handwriting and typing notes"]),
    ("Summarize {}.", [
        "the story of Snow White", "the story of the Ugly Duckling", "the story of Peter Pan",
        "the story of Pinocchio", "the plot of Alice in Wonderland", "the story of Hansel and Gretel",
        "the story of the tortoise and the hare", "the plot of The Wizard of Oz", "the story of Sleeping Beauty",
        "the story of Aladdin", "the story of Rapunzel", "the plot of Treasure Island",
        "the story of the Little Mermaid", "the plot of Robinson Crusoe", "the story of the Trojan Horse",
        "the myth of Icarus", "the story of Beauty and the Beast", "the plot of A Christmas Carol"]),
    ("{}", [
        "What is the capital of Canada?", "What is the largest desert in the world?",
        "How many planets are in the solar system?",
        "What is the largest animal on Earth?", "Who painted the Mona Lisa?", "What is the coldest place on Earth?",
        "What language is spoken in Mexico?", "What is the capital of Italy?", "How many players are on a soccer team?",
        "What is the chemical symbol for water?", "What is the largest country in the world?",
        "Who wrote Pride and Prejudice?",
        "How many hearts does an octopus have?", "What is the freezing point of water?", "Which animal is the tallest?",
        "What is the capital of Egypt?", "What is the closest star to Earth?", "Who discovered penicillin?",
        "What is the deepest ocean trench?", "How many strings does a guitar have?", "What is the currency of Japan?",
        "Which bird is the fastest?", "What is the biggest bone in the human body?", "What is the capital of Kenya?",
        "How long does it take light from the Sun to reach Earth?", "What is the most spoken language in the world?",
        "Who was the first person to walk on the Moon?", "What is the smallest planet in the solar system?"]),
    ("{}", [
        "Rewrite this sentence to sound more polite: Give me the report now.",
        "Correct the grammar in this sentence: Me and him goes to the park.",
        "Make this sentence shorter: Due to the fact that it was raining, we decided to stay inside.",
        "Rewrite this sentence in the future tense: She plays the piano.",
        "Turn this into a question: The train leaves at noon.",
        "Rewrite this sentence in a more cheerful tone: The store is closed today.",
        "Fix the spelling in this sentence: I recieved the pakage yesterday.",
        "Rewrite this in simple words: The committee reached a unanimous decision.",
        "Make this sentence more descriptive: The house was old.",
        "Rewrite this sentence in the passive voice: The chef cooked the meal.",
        "Combine these sentences into one: I was tired. I went to bed early.",
        "Rewrite this sentence so a child can understand it: Photosynthesis converts light into chemical energy.",
        "Make this email opening more formal: Hi guys, quick update.",
        "Rewrite this sentence without the word really: The movie was really long."]),
    ("{}", [
        "Name five animals that live in the ocean.", "List five vegetables that grow underground.",
        "Name three famous composers.", "List four seasons of the year and one thing about each.",
        "Name five sports played with a ball.", "List three countries in South America.",
        "Give me five words that rhyme with light.", "Name four birds that cannot fly.",
        "List five things to bring to the beach.", "Name three inventions that changed the world.",
        "List the colors of the rainbow.", "Name five kinds of trees.", "Give me five antonyms for big.",
        "List four kinds of weather.", "Name three rivers in Africa.", "List five jobs that help people.",
        "Name five farm animals.", "Give me three fun facts about the Moon.", "List five kitchen tools.",
        "Name four famous scientists.", "List the months of the year that have 31 days.",
        "Name five insects.", "List three ways to get to school."]),
    ("What does {} mean?", [
        "the word curious", "the idiom piece of cake", "the phrase hit the road", "the word generous",
        "the idiom under the weather", "the word nostalgia", "the phrase call it a day", "the word brave",
        "the idiom spill the beans", "the word sustainable", "the phrase a blessing in disguise",
        "the word ambiguous", "the word diligent", "the idiom cost an arm and a leg"]),
    ("What is {}?", [
        "a noun", "a verb", "an adverb", "a pronoun", "a simile", "an antonym", "a paragraph",
        "alliteration", "a compound word", "a preposition", "a syllable", "a homophone"]),
    ("Give me three ideas for {}.", [
        "a school project about the ocean", "a family game night", "a short story", "a garden on a small balcony",
        "a rainy Sunday", "a class party", "a healthy snack", "a new hobby", "a surprise for my mother",
        "a summer holiday at home", "a bake sale", "a team building activity", "a themed dinner party",
        "a photography project", "a short video for social media"]),
    ("{}", [
        "Is it healthy to eat eggs every day?", "Is it good to take a nap in the afternoon?",
        "Should I drink water before a meal?", "Is it better to walk or to cycle to work?",
        "Is it safe to swim right after eating?", "Should I learn to play the piano or the guitar?",
        "Is it bad to sit all day?", "Should I buy a new phone or repair my old one?",
        "Is breakfast really the most important meal?", "Is it good to listen to music while studying?"]),
    ("Tell me {}.", [
        "a joke about cats", "a joke about math", "a riddle about time", "a fun fact about frogs",
        "a joke about the weather", "a fun fact about the Sun", "a short joke for kids", "a riddle about animals",
        "a fun fact about penguins", "an interesting fact about volcanoes", "a joke about school",
        "a fun fact about trees", "a pun about food", "an interesting fact about the Moon",
        "something interesting about sharks", "a fun fact about the Eiffel Tower"]),
    ("How do I {}?", [
        "plant a tree", "clean a cast iron pan", "make a paper crane", "remove a coffee stain from a shirt",
        "iron a shirt", "grow herbs indoors", "change a light bulb", "unclog a sink", "sew on a button",
        "get rid of ants in the kitchen", "pack a suitcase efficiently", "train for a five kilometer run",
        "care for a cactus", "clean windows without streaks", "start composting at home", "jump start a car",
        "set up a fish tank", "wrap a present neatly", "make a bed neatly", "learn to juggle",
        "teach a child to ride a bike", "write a short story", "study for a math test", "plan a road trip",
        "make a good cup of coffee", "keep bread fresh longer", "care for a rabbit", "prepare for a hike"]),
    ("What does {} do?", [
        "a dentist", "a pharmacist", "a police officer", "a journalist", "a veterinarian", "an electrician",
        "a baker", "a mail carrier", "a scientist", "a lawyer", "a gardener", "an accountant",
        "a photographer", "a plumber", "a zookeeper", "a translator", "a museum curator", "a lifeguard"]),
    ("Describe {}.", [
        "a quiet beach at sunrise", "a crowded train station", "a small bakery in the morning",
        "an old castle on a hill", "a walk in the rain", "a summer fair", "a farm at harvest time",
        "a busy city street at night", "a campfire under the stars", "a calm lake in the mountains",
        "a classroom on the first day of school", "the taste of fresh strawberries", "a thunderstorm at sea",
        "a garden full of flowers", "an autumn forest", "a cozy cabin in winter", "a fishing village",
        "the sound of the ocean", "a bustling airport", "a hot summer afternoon"]),
    ("Why is {}?", [
        "recycling important", "it important to wash our hands", "exercise good for the heart",
        "the Amazon rainforest important", "it good to learn a second language", "breakfast important",
        "it important to wear sunscreen", "music good for the mind", "it important to save money",
        "kindness important", "clean air important", "it good to spend time outdoors",
        "honesty important", "it important to vote", "play important for children"]),
    ("{}", [
        "Explain the rules of badminton.", "What are the basic rules of basketball?", "How do you play checkers?",
        "Explain the rules of baseball in simple terms.", "How do you play the card game Uno?",
        "What are the rules of musical chairs?", "Explain how to play hopscotch.", "How is golf played?",
        "What are the rules of table tennis?", "How do you play Monopoly?", "Explain the rules of rugby briefly.",
        "How do you play the game Simon says?", "What are the rules of a relay race?",
        "How do you play dominoes?", "Explain how to play sudoku."]),
    # A second set, appended so that the first 675 prompts (run7's first three data files) keep
    # their places.
    ("How does {} work?", [
        "a rocket", "a car engine", "a piano", "the internet router at home", "a helicopter", "a toaster",
        "a sewing machine", "an electric car", "a water filter", "a vacuum cleaner", "a doorbell",
        "a hearing aid", "a digital clock", "a fridge magnet", "a loudspeaker", "a lighthouse lamp",
        "a rain gauge", "an escalator", "a sailboat", "a dam", "a printer", "a scale for weighing food"]),
    ("What are the benefits of {}?", [
        "drinking green tea", "learning to play chess", "keeping a diary", "yoga", "gardening",
        "volunteering", "riding a bike to work", "eating fish", "playing team sports", "learning history",
        "taking short breaks while working", "spending time with grandparents", "cooking at home",
        "learning to code", "stretching every morning", "having a pet dog", "visiting museums",
        "writing by hand", "living near a park", "getting up early"]),
    ("What are some tips for {}?", [
        "a first job interview", "learning to draw", "keeping a budget", "moving to a new home",
        "traveling with a baby", "hiking in hot weather", "studying in a noisy place", "writing a poem",
        "taking care of a cat", "running a long race", "cooking for a large group", "driving in the snow",
        "learning to ski", "giving a presentation", "keeping a small apartment tidy", "painting a room",
        "planning a wedding", "growing strawberries", "shopping for groceries on a budget", "sleeping on a plane"]),
    ("Write a poem about {}.", [
        "a grandfather's garden", "the first day of spring", "a train journey", "a red balloon",
        "a rainy window", "an old bicycle", "the night sky over the sea", "a loyal dog", "a kitchen in the morning",
        "a mountain path", "a quiet library", "a birthday candle", "the last leaf on a tree", "a harbor at dawn"]),
    ("Write a bedtime story about {}.", [
        "a little owl who cannot sleep", "a star that falls into the sea", "a bunny who is scared of the dark",
        "a cloud who wants to be a rainbow", "a sleepy bear in winter", "a tiny turtle on a big adventure",
        "a moon that loses its glow", "a kitten and a ball of yarn", "a train that travels through the night",
        "a little mouse who dreams of cheese"]),
    ("Write an email to {}.", [
        "a teacher asking for help with homework", "a landlord about a broken heater",
        "a client thanking them for their order",
        "my team about a new meeting time", "a friend I have not seen in years", "a hotel asking about a late check-in",
        "a coworker asking for feedback on a report", "a shop asking about a refund",
        "my neighbors about a street party",
        "a company asking about a job opening", "a coach saying my child will miss practice",
        "the school about a change of address"]),
    ("Explain {} to a child.", [
        "why we pay taxes", "what a map is", "how a plane stays in the air", "why we have rules", "what money is",
        "how the Internet works", "why the Moon changes shape", "what a dinosaur was", "why we recycle",
        "how a baby bird hatches", "what a country is", "why we need bees", "how a car moves",
        "why the sea has waves", "what the heart does", "why we have day and night"]),
    ("What is the history of {}?", [
        "pizza", "the bicycle helmet", "jeans", "the calendar", "ice cream", "the umbrella", "coffee",
        "the alphabet", "soccer", "the computer mouse", "the postal service", "glasses", "the violin",
        "the marathon", "the zipper", "the teddy bear", "basketball", "the lightbulb"]),
    ("What should I know before {}?", [
        "adopting a cat", "buying a used car", "starting a small business", "going on a safari",
        "learning to scuba dive", "running my first marathon", "buying a house", "getting a tattoo",
        "traveling to Japan", "starting college", "planting a lawn", "buying a laptop", "keeping chickens",
        "going camping alone", "taking a long flight"]),
    ("{}", [
        "A box holds 12 eggs. How many boxes do I need for 60 eggs?", "What is 9 times 7?",
        "If a movie starts at 7:30 and lasts 2 hours, when does it end?", "What is 144 divided by 12?",
        "How do you find the area of a triangle?", "What is the next number: 2, 4, 8, 16?",
        "How many centimeters are in a meter?", "If I walk 3 kilometers a day, how far do I walk in a week?",
        "What is a fraction?", "How do you subtract negative numbers?", "What is the value of 2 to the power of 5?",
        "If 5 friends share 40 cookies equally, how many does each get?", "What is a right angle?",
        "How many grams are in a kilogram?", "Explain what an equation is.", "What is the median of 3, 9, 4, 7 and 5?",
        "How do you convert a fraction to a percentage?", "What is 3/4 plus 1/8?",
        "A store sells pens at 2 dollars each. How much do 15 pens cost?", "How many sides does a hexagon have?"]),
    ("{}", [
        "What is the capital of Spain?", "How many teeth does an adult human have?",
        "What is the tallest building in the world?",
        "Which ocean is the smallest?", "Who invented the telephone?", "What is the main language of Argentina?",
        "How many colors are in a rainbow?", "What is the largest island in the world?", "Who wrote The Odyssey?",
        "What is the national animal of Scotland?", "How long is a marathon?", "What is the hottest planet?",
        "Where do penguins live?", "What is the capital of Germany?", "What metal is liquid at room temperature?",
        "Which continent is the largest?", "What do caterpillars turn into?", "How many keys are on a piano?",
        "What is the most common gas in the air?", "Who composed the Four Seasons?"]),
    ("{}", [
        "Suggest a name for a new bakery.", "Suggest a name for a hiking blog.",
        "What is a good name for a pet turtle?",
        "Suggest a title for a mystery novel.", "Suggest a name for a robot in a children's story.",
        "Suggest three names for a school newspaper.", "What is a good name for a band?",
        "Suggest a motto for a running club.", "Suggest a name for a flower shop.",
        "Suggest a name for a video game about space."]),
    ("What are the pros and cons of {}?", [
        "working part time", "living in a small town", "homeschooling", "online shopping", "public transport",
        "a vegetarian diet", "remote work", "owning a car in a city", "studying abroad", "video games for children",
        "solar energy", "a four-day work week", "wearing a school uniform", "traveling alone"]),
    ("Tell me {}.", [
        "a fun fact about bees", "a joke about dogs", "an interesting fact about the human heart",
        "a fun fact about the Amazon river", "a riddle about numbers", "a joke about pirates",
        "a fun fact about cheetahs", "something surprising about bananas", "an interesting fact about Mars",
        "a knock-knock joke", "a fun fact about rainbows", "a tongue-twister about snakes"]),
    ("Describe {}.", [
        "a medieval marketplace", "a spaceship control room", "a rainy night in a big city",
        "a birthday party for a child",
        "a desert at noon", "a winter holiday market", "an underwater coral reef", "a cottage by a river",
        "a football stadium before a match", "a train ride through the countryside", "a bakery window at Christmas",
        "a playground on a sunny day", "a foggy morning by the sea", "a jungle at night"]),
    ("What skills does {} need?", [
        "a good nurse", "a pilot", "a software developer", "a chef", "a team leader", "a writer",
        "a carpenter", "a soccer coach", "a salesperson", "a scientist", "a musician", "a firefighter"]),
]


# The third set (drafter_prompts_more2.json, `--set 2`): new templates and topics of the same
# kinds of task, rendered after the first file's prompts are taken (none repeats one of them).
KINDS_2: list[tuple[str, list[str]]] = [
    ("How does {} work?", [
        "a refrigerator", "a compass", "a toaster", "a vacuum cleaner", "a car engine", "a zipper",
        "an escalator", "a calculator", "a fire extinguisher", "a water filter", "a sewing machine",
        "a remote control", "a doorbell", "a loudspeaker", "a satellite", "a rocket", "a helicopter",
        "a sailboat", "a heart", "a kidney", "a volcano", "an earthquake", "a windmill", "a GPS receiver",
        "a touch screen", "a hearing aid", "a pressure cooker", "a kettle", "a hair dryer", "a piano",
        "a printer", "a scanner", "an electric car", "a traffic camera", "a nuclear power plant"]),
    ("Why does {}?", [
        "the sky turn red at sunset", "the moon change shape", "a balloon float", "salt melt ice",
        "milk go sour", "a cut heal", "hair turn gray", "the wind blow", "a ship float", "thunder follow lightning",
        "a boomerang come back", "the sea taste salty", "a candle go out in a jar", "popcorn pop",
        "a compass point north", "a mirror reverse images", "paper turn yellow with age", "iron rust",
        "soda fizz", "a cat purr", "the heart beat faster when we run", "grass grow back after mowing",
        "the sun look bigger at the horizon", "an onion make us cry", "ice cream melt so fast"]),
    ("What causes {}?", [
        "earthquakes", "rain", "thunderstorms", "seasons", "rust", "wind", "fog", "snow", "hail", "tsunamis",
        "droughts", "floods", "tides", "the northern lights", "a rainbow after a storm", "headaches",
        "a cold", "allergies", "sunburn", "tooth decay", "muscle cramps", "jet lag", "hiccups", "volcanoes to erupt",
        "leaves to change color in autumn", "a sonic boom", "an echo", "static shocks", "a heat wave",
        "ocean currents"]),
    ("Explain {} to a beginner.", [
        "photosynthesis", "gravity", "magnetism", "the water cycle", "the food chain", "plate tectonics",
        "the solar system", "supply and demand", "a budget", "interest on a loan", "taxes", "the internet",
        "cloud storage", "machine learning", "a database", "an algorithm", "a computer network", "sound waves",
        "light and color", "the human skeleton", "blood circulation", "the nervous system", "genes and DNA",
        "the metric system", "fractions", "percentages", "probability", "a map and its scale", "time zones",
        "how a bill becomes a law", "the stock exchange", "renewable energy", "electric circuits",
        "chemical reactions", "the periodic table"]),
    ("Who invented {}?", [
        "the telephone", "the light bulb", "the printing press", "the airplane", "the radio", "the computer",
        "the World Wide Web", "the steam engine", "the bicycle", "the camera", "the television", "paper money",
        "the telescope", "the microscope", "the car", "the sewing machine", "the refrigerator", "the battery",
        "the pencil", "the zipper"]),
    ("What happened during {}?", [
        "the Renaissance", "the fall of the Roman Empire", "the moon landing", "the Norman conquest of England",
        "the Crusades", "the Irish potato famine", "the Great Fire of London", "the Spanish Armada",
        "the Russian Revolution", "the Protestant Reformation", "the Civil Rights Movement",
        "the fall of Constantinople", "the building of the Great Wall of China", "the first Olympic Games",
        "the Age of Sail", "the partition of India", "the Dust Bowl", "the California gold rush",
        "the invention of the steam locomotive", "the signing of the Magna Carta"]),
    ("Tell me about {}.", [
        "the ancient Egyptians", "the history of chocolate", "the Roman Colosseum", "the history of the bicycle",
        "the Great Barrier Reef", "the Amazon rainforest", "the Sahara desert", "Mount Everest", "the Nile river",
        "the history of the Olympic Games", "the Statue of Liberty", "the pyramids of Giza", "Stonehenge",
        "the history of soccer", "the history of jazz", "the Mongol Empire", "the Hanseatic League",
        "the history of the printing press", "ancient India", "the Maori people", "the Arctic",
        "Antarctica", "the Grand Canyon", "the Mediterranean Sea", "the history of the postal service",
        "the history of coffee", "the history of the umbrella", "the history of the calendar",
        "the Galapagos Islands", "the history of vaccines"]),
    ("Tell me three facts about {}.", [
        "elephants", "octopuses", "the sun", "the moon", "Mars", "Jupiter", "honey", "sharks", "penguins",
        "dolphins", "owls", "the human brain", "bananas", "volcanoes", "spiders", "whales", "kangaroos",
        "snails", "the Pacific Ocean", "camels", "crows", "ants", "polar bears", "tigers", "koalas",
        "the Eiffel Tower", "Japan", "Brazil", "Canada", "Egypt", "Australia", "India", "Iceland",
        "Mexico", "Norway", "Kenya", "Peru", "Italy", "the Moon landing", "diamonds"]),
    ("What is {}?", [
        "a black hole", "a rainforest", "a tsunami", "an ecosystem service", "a coral reef", "a desert",
        "a glacier", "a tornado", "a meteor", "a constellation", "a planet", "a mammal", "a reptile",
        "an amphibian", "a carnivore", "a herbivore", "a volcano", "a peninsula", "a continent", "an island",
        "a delta", "a canyon", "a savanna", "a tundra", "a fjord", "a monsoon", "a virus", "a bacterium",
        "a protein", "a vitamin", "a calorie", "a neuron", "a hormone", "an allergy", "a gene",
        "a democracy", "a monarchy", "a constitution", "a tax", "a loan", "a mortgage", "a budget",
        "a stock", "a bond", "a startup", "a pension", "a password manager", "a search engine",
        "an email attachment", "a download", "an operating system update", "a software license",
        "a database index", "a neural network", "a pixel", "a megabyte", "a spreadsheet formula",
        "open source software", "a backup", "a VPN"]),
    ("Write a Python function that {}.", [
        "reverses a string", "counts the vowels in a word", "returns the product of a list of numbers",
        "removes duplicates from a list", "checks whether a number is prime", "returns the factorial of a number",
        "converts Fahrenheit to Celsius", "finds the longest word in a list", "sorts a list of names",
        "returns the odd numbers of a list", "checks whether two words are anagrams",
        "counts the lines in a text file", "returns the first n square numbers", "flattens a list of lists",
        "adds two numbers", "checks whether a string contains only digits", "returns the middle element of a list",
        "swaps the keys and values of a dictionary", "returns the sum of the digits of a number",
        "checks whether a number is even", "converts kilometers to miles", "returns the maximum of three numbers",
        "counts the words that start with a capital letter", "joins a list of words with commas",
        "returns the number of days in a month"]),
    ("How do I {} in Python?", [
        "sort a dictionary by value", "remove an item from a list", "copy a list", "read a text file line by line",
        "get the length of a string", "check the type of a variable", "use a for loop", "define a function",
        "return two values from a function", "use a list comprehension", "convert a list to a set",
        "add an item to a dictionary", "get user input", "print without a newline", "sleep for one second",
        "make a string lowercase", "check if a string starts with a word", "count items in a list",
        "write a docstring", "run a Python script"]),
    ("What is the difference between {}?", [
        "a virus and a bacterium", "a frog and a toad", "a crocodile and an alligator", "a moth and a butterfly",
        "a lake and a pond", "a hill and a mountain", "a sea and an ocean", "a village and a town",
        "a rabbit and a hare", "a turtle and a tortoise", "an ape and a monkey", "a star and a planet",
        "speed and velocity", "mass and weight", "heat and temperature", "a fruit and a vegetable",
        "baking soda and baking powder", "a loan and a grant", "a debit card and a credit card",
        "a laptop and a desktop computer", "RAM and storage", "a website and a web app",
        "a function and a method", "a compiler and an interpreter", "a doctor and a nurse",
        "a poem and a song", "a novel and a short story", "a museum and a gallery", "an emu and an ostrich",
        "a cold and the flu"]),
    ("Compare {}.", [
        "cats and dogs as pets", "trains and planes for travel", "reading books and watching movies",
        "tea and coffee", "summer and winter holidays", "working from home and working in an office",
        "walking and running for exercise", "paper books and e-books", "public schools and homeschooling",
        "living alone and living with roommates", "renting and buying a home", "cooking at home and eating out",
        "electric cars and petrol cars", "the violin and the cello", "email and phone calls",
        "chess and checkers", "swimming and cycling", "the north and the south pole",
        "a big city and a small town for raising children", "learning online and learning in a classroom"]),
    ("Summarize {}.", [
        "the story of Cinderella", "the plot of Hamlet", "the story of Little Red Riding Hood",
        "the plot of The Wizard of Oz", "the story of the Trojan Horse", "the plot of Moby Dick",
        "the story of Robin Hood", "the plot of Pride and Prejudice", "the story of King Arthur",
        "the plot of Alice in Wonderland", "the story of the three little pigs", "the plot of Macbeth",
        "the story of Hansel and Gretel", "the plot of Treasure Island", "the story of Jack and the Beanstalk",
        "the plot of Frankenstein", "the story of Snow White", "the plot of Oliver Twist",
        "the story of the tortoise and the hare", "the plot of The Odyssey", "the life of Isaac Newton",
        "the history of the Roman Republic", "the story of Aladdin", "the plot of Don Quixote"]),
    ("Write a poem about {}.", [
        "the sea", "a city at night", "friendship", "the first snow", "a forest in autumn", "a lost glove",
        "the rain on a window", "an old bicycle", "a kitchen in the morning", "a long road", "the harvest moon",
        "a mother's hands", "a lighthouse keeper", "a river in spring", "the end of summer", "a paper kite",
        "a village church bell", "a quiet library", "a field of wheat", "a fox in the snow"]),
    ("Write a haiku about {}.", [
        "the wind", "a summer night", "a river stone", "falling snow", "a cup of tea", "a spider's web",
        "the full moon", "a bamboo forest", "an empty beach", "morning fog", "a sparrow", "the first frost",
        "a thunderstorm", "a garden after rain", "a sleeping dog"]),
    ("Write a short story about {}.", [
        "a dragon who is afraid of fire", "a girl who can talk to birds", "a clock that runs backwards",
        "a penguin who wants to visit the desert", "a lost puppy finding its way home",
        "a boy who builds a rocket in his garden", "a magic paintbrush", "a haunted lighthouse",
        "a turtle who wins a race", "a detective who solves a mystery at a zoo", "a tree that can walk",
        "an owl who cannot sleep at night", "a wizard who forgets his spells", "a train that travels to the moon",
        "a family of mice in a big house", "a rabbit who becomes king", "a girl who finds a map in a bottle",
        "a robot who learns to paint", "a town where it never stops raining", "a squirrel who saves the forest",
        "a princess who wants to be a knight", "an elephant who is afraid of mice", "two sisters on a camping trip",
        "a baker and a hungry giant", "a cloud who wants to be a rainbow"]),
    ("Write an email to {}.", [
        "my landlord about a broken heater", "my teacher asking for an extension", "a colleague to schedule a meeting",
        "a hotel asking about a late check-in", "my team about the holiday schedule", "a customer thanking them for an order",
        "a friend I have not seen in years", "my manager asking for a day off", "a shop asking to return a jacket",
        "a neighbor about a noisy party", "the school about my child's absence", "a company applying for a job",
        "a client to follow up after a meeting", "a plumber asking for a quote", "my gym to cancel my membership",
        "a restaurant to book a table for ten", "the city council about a broken street light",
        "a new employee to welcome them", "a speaker to invite them to a conference", "my bank about a wrong charge"]),
    ("Write a {}.", [
        "short speech for a friend's wedding", "thank-you note to a teacher", "short review of a coffee shop",
        "product description for a wool scarf", "short advertisement for a bakery", "cover letter for a barista job",
        "product description for a coffee mug", "short bio for a yoga teacher", "message to welcome new neighbors",
        "note to apologize for missing a meeting", "short description of a hiking trail", "post announcing a bake sale",
        "short invitation to a birthday party", "product description for a garden hose", "recipe card for pancakes",
        "short review of a science fiction movie", "message congratulating a coworker on a promotion",
        "short notice about a lost cat", "short guide to a city's best parks", "product description for a tent",
        "short farewell message for a colleague", "short story opening line", "limerick about a cat",
        "short motivational message for students before exams", "job ad for a part-time cashier"]),
    ("How can I {}?", [
        "learn a new language", "save money on groceries", "improve my handwriting", "wake up earlier",
        "drink more water", "reduce stress", "become a better writer", "make friends at work",
        "improve my posture", "study for an exam", "manage my time better", "learn to cook",
        "be more confident when speaking in public", "keep my house clean", "start running",
        "grow herbs on a windowsill", "focus better while studying", "plan a budget", "get over jet lag",
        "teach my dog to sit", "prepare for a job interview", "stay healthy while traveling",
        "learn to play the guitar", "make my room look bigger", "help the environment at home"]),
    ("What are some tips for {}?", [
        "writing an essay", "a long flight", "cooking rice", "learning to drive", "painting a room",
        "a first job", "moving to a new country", "camping in the rain", "running a marathon", "baking bread",
        "taking care of a cat", "growing potatoes", "saving for a holiday", "making a speech", "starting a blog",
        "keeping a diary", "packing light", "shopping for a used car", "meeting new people", "working at night"]),
    ("Give me a recipe for {}.", [
        "tomato soup", "pancakes", "a chicken sandwich", "spaghetti with garlic and oil", "vegetable stir fry",
        "potato salad", "apple pie", "rice pudding", "a smoothie", "chili con carne", "lentil soup",
        "a simple tomato sauce", "roasted vegetables", "brownies", "hummus", "a tuna salad", "carrot cake",
        "garlic bread", "a bean burrito", "chicken noodle soup", "pumpkin soup", "blueberry muffins",
        "a cheese omelette", "fish tacos", "a Greek salad"]),
    ("What is {}?", [
        "12 times 12", "20 percent of 150", "the square root of 81", "half of 250", "a quarter of 60",
        "30 percent of 90", "15 plus 27", "144 divided by 12", "the sum of the numbers from 1 to 10",
        "5 cubed", "3 times 17", "the average of 10, 20 and 30", "two thirds of 30", "9 times 9",
        "1000 minus 357", "40 percent of 250", "the perimeter of a square with sides of 5 cm",
        "the area of a rectangle 4 m by 6 m", "a prime number", "a fraction", "a decimal number",
        "an equation", "a right angle", "a triangle", "the circumference of a circle"]),
    ("How do you {}?", [
        "convert kilograms to pounds", "calculate a percentage", "find the area of a triangle",
        "add fractions", "convert inches to centimeters", "work out a tip at a restaurant",
        "calculate simple interest", "divide by a fraction", "round a number to the nearest ten",
        "find the volume of a box", "convert hours to minutes", "multiply decimals", "find the median of a list",
        "calculate speed from distance and time", "convert a fraction to a percentage"]),
    ("What is the {}?", [
        "tallest mountain in the world", "largest ocean on Earth", "biggest desert in the world",
        "smallest country in the world", "fastest land animal", "largest planet in the solar system",
        "capital of Australia", "capital of Canada", "capital of Japan", "largest animal on Earth",
        "coldest place on Earth", "deepest lake in the world", "longest wall in the world",
        "most spoken language in the world", "largest country in South America", "hottest planet",
        "biggest bone in the human body", "largest organ of the human body", "oldest city in Europe",
        "boiling point of water", "speed of light", "closest star to Earth", "national animal of Scotland",
        "main language of Brazil", "currency of Japan"]),
    ("Who wrote {}?", [
        "Pride and Prejudice", "The Odyssey", "Don Quixote", "War and Peace", "The Little Prince",
        "Oliver Twist", "Moby Dick", "Frankenstein", "The Hobbit", "Romeo and Juliet", "Alice in Wonderland",
        "The Divine Comedy", "Treasure Island", "Robinson Crusoe", "The Jungle Book"]),
    ("Make this sentence simpler: {}", [
        "The meeting has been postponed to a later date due to unforeseen circumstances.",
        "It is imperative that all employees adhere to the safety regulations.",
        "The child exhibited considerable reluctance to consume his vegetables.",
        "We regret to inform you that your application has been unsuccessful.",
        "The weather conditions are anticipated to deteriorate this evening.",
        "Please ensure that all doors are securely fastened prior to departure.",
        "The aforementioned product is currently unavailable for purchase.",
        "The committee reached a unanimous decision after lengthy deliberation.",
        "Individuals who wish to participate should register in advance.",
        "The restaurant endeavors to provide exceptional culinary experiences."]),
    ("Rewrite this sentence to sound more polite: {}", [
        "Give me the report now.", "Move your car.", "Stop talking during the movie.", "Send me the file.",
        "You are late again.", "Turn the music down.", "Fix this mistake.", "Call me back.",
        "I want a refund.", "Answer my email."]),
    ("Correct the grammar in this sentence: {}", [
        "She don't like apples.", "Me and him went to the store.", "They was playing football.",
        "I has two brothers.", "He go to school every day.", "We was happy to see you.",
        "The dogs is barking.", "She have a red car.", "Their going to the park.", "I seen that movie."]),
    ("Translate into French: {}", [
        "Good morning, how are you?", "Where is the train station?", "I would like a cup of coffee.",
        "Thank you very much.", "What time is it?", "I love reading books.", "The weather is nice today.",
        "My name is Anna.", "How much does this cost?", "See you tomorrow."]),
    ("List {}.", [
        "five fruits that are red", "five musical instruments", "five things to do on a rainy day",
        "the planets of the solar system", "five famous painters", "five sports played with a ball",
        "the seven continents", "five vegetables that grow underground", "five animals that live in the ocean",
        "five countries in Asia", "five countries in Africa", "five birds that cannot fly",
        "the days of the week in Spanish", "five words that rhyme with cat", "five kitchen tools",
        "five jobs in a hospital", "five board games for families", "five flowers that bloom in spring",
        "five things to pack for a hike", "five healthy snacks", "five famous scientists",
        "five colors of the rainbow", "five ways to say hello", "five types of clouds", "five rivers in Europe"]),
    ("What does the word {} mean?", [
        "serendipity", "resilient", "ubiquitous", "benevolent", "meticulous", "nostalgia", "candid",
        "diligent", "eloquent", "frugal", "gregarious", "humble", "inevitable", "jovial", "lucid",
        "melancholy", "novice", "obsolete", "pragmatic", "quaint", "reluctant", "sincere", "tedious",
        "vivid", "whimsical", "ambiguous", "curious", "tranquil", "zealous", "empathy"]),
    ("What is {} in grammar?", [
        "a noun", "a verb", "an adverb", "a pronoun", "a preposition", "a conjunction", "a sentence",
        "a paragraph", "a plural", "the past tense", "a question mark", "a comma", "a synonym", "an antonym",
        "a prefix"]),
    ("Give me three ideas for {}.", [
        "a rainy afternoon", "a birthday party", "a school project about space", "a short story",
        "a family game night", "a cheap date", "a team building activity", "a garden design",
        "a healthy breakfast", "a small business", "a YouTube channel", "a holiday gift for my mother",
        "a mystery novel", "a class trip", "a fun science experiment", "a themed dinner party",
        "a school fundraiser", "a summer camp activity", "a podcast", "a reading challenge"]),
    ("Tell me a joke about {}.", [
        "cats", "math", "teachers", "the weather", "coffee", "doctors", "bananas", "dinosaurs", "pirates",
        "penguins", "robots", "the ocean", "pizza", "music", "elephants"]),
    ("Tell me a fun fact about {}.", [
        "space", "the ocean", "the human body", "ancient Rome", "cats", "dogs", "bees", "trees", "chocolate",
        "the moon", "frogs", "language", "music", "clouds", "sleep"]),
    ("How do I {}?", [
        "change a flat tire", "tie a tie", "boil an egg", "clean a laptop screen", "iron a shirt",
        "write a resume", "start a vegetable garden", "learn to juggle three balls", "fold a fitted sheet",
        "set up a new phone", "make a budget spreadsheet", "sharpen a kitchen knife", "wash a wool sweater",
        "plant a tree", "remove a stain from a shirt", "build a campfire safely", "hang a picture on a wall",
        "back up my photos", "unclog a sink", "paint a wooden chair", "care for a cactus", "ride a bike",
        "make a paper crane", "choose a good watermelon", "clean a cast iron pan"]),
    ("What does {} do?", [
        "a teacher", "a pilot", "an architect", "a farmer", "a firefighter", "a librarian", "a dentist",
        "a lawyer", "a journalist", "an electrician", "a mechanic", "a nurse", "a police officer",
        "a software engineer", "an accountant", "a pharmacist", "a plumber", "a carpenter", "a veterinarian",
        "a museum curator", "a translator", "a photographer", "a judge", "a scientist", "a gardener"]),
    ("What skills does {} need?", [
        "a good waiter", "a bus driver", "a school principal", "a web designer", "a chef", "a tour guide",
        "a writer", "a shop manager", "a soccer coach", "a data analyst", "a pilot", "a midwife",
        "a receptionist", "a translator", "a fitness trainer"]),
    ("Describe {}.", [
        "a quiet beach at sunrise", "a crowded train in the morning", "a forest after the rain",
        "an old bookshop", "a farmer's market in summer", "a thunderstorm over the sea",
        "a busy airport", "a small fishing village", "a school playground at recess", "a desert at night",
        "a garden in spring", "a cozy cafe in winter", "a city street at midnight", "a mountain lake at dawn",
        "a birthday party for a five-year-old", "a football stadium on match day", "a hospital waiting room",
        "a night sky full of stars", "a rainy Sunday afternoon at home", "an autumn park",
        "a kitchen during a family dinner", "a science museum", "a farm in the morning",
        "a bustling harbor", "a field of lavender"]),
    ("Why is {}?", [
        "the ocean blue", "exercise good for the brain", "reading important for children", "sleep important",
        "water important for the body", "the Amazon rainforest important", "the sun hot", "Mars red",
        "the Dead Sea so salty", "snow white", "breakfast called the most important meal",
        "the Earth round", "voting important", "history worth studying", "music good for us",
        "recycling plastic hard", "the moon visible during the day", "honey so sweet", "the desert dry",
        "the Great Wall of China famous"]),
    ("What are the benefits of {}?", [
        "walking every day", "learning to cook", "drinking tea", "playing chess", "learning a second language",
        "gardening", "volunteering", "swimming", "journaling", "meditation", "eating fish",
        "having a pet", "cycling to work", "reading fiction", "playing a team sport", "napping",
        "stretching", "spending time in nature", "learning to code", "keeping a budget"]),
    ("What are the pros and cons of {}?", [
        "social media", "working part time", "online shopping", "living abroad", "nuclear energy",
        "having a car in the city", "school uniforms", "video games", "fast food", "homework",
        "solar panels", "a four-day work week", "open plan offices", "smartphones for children",
        "public transport", "studying abroad", "self-driving cars", "owning a house", "freelancing",
        "eating meat"]),
    ("Explain the rules of {}.", [
        "soccer", "basketball", "volleyball", "checkers", "poker", "table tennis", "badminton", "golf",
        "rugby", "baseball", "cricket", "hide and seek", "tic-tac-toe", "Monopoly", "Scrabble",
        "bowling", "ice hockey", "dominoes", "rock paper scissors", "Uno"]),
    ("Is it {}?", [
        "healthy to eat eggs every day", "safe to swim after eating", "bad to crack your knuckles",
        "good to stretch before running", "okay to drink milk every day", "better to study in the morning",
        "safe to leave a phone charging overnight", "good to walk barefoot", "bad to skip breakfast",
        "true that goldfish have a short memory", "true that lightning never strikes twice",
        "healthy to drink fruit juice", "better to rent or buy a car", "good to nap in the afternoon",
        "normal to feel nervous before a test"]),
    # Appended after the first 839 prompts were rendered (run8's first four data files keep their places).
    ("Write a thank-you message to {}.", [
        "my grandmother for a birthday gift", "a nurse who cared for my father", "my coach after a great season",
        "a friend who helped me study", "my host family after a stay abroad", "a volunteer at the food bank",
        "the bus driver who found my wallet", "a mentor at work", "my parents for supporting me",
        "a neighbor who watered my plants", "my team after finishing a big project", "a waiter for great service",
        "a librarian who helped with my research", "my brother for driving me to the airport",
        "a guest speaker at our school"]),
    ("Explain why {}.", [
        "the sky is dark at night", "we have leap years", "planes can fly", "boats made of steel float",
        "we need to sleep", "leaves are green", "the ocean has waves", "bread goes stale", "we have different time zones",
        "the Earth has seasons", "some people are left-handed", "cats like boxes", "stars twinkle",
        "we need vitamins", "ice is slippery", "the Moon has craters", "onions have layers", "vaccines work",
        "we blink", "soap cleans our hands"]),
    ("Tell me a short story for children about {}.", [
        "a brave little turtle", "a cloud that could not rain", "a bunny who loved carrots", "a kind dragon",
        "a lost star", "a duck who learned to swim", "a tiny seed", "a friendly ghost", "a bear who could not sleep",
        "a train that was always late", "a little red balloon", "a very hungry goat", "a sock that lost its pair",
        "a moon that wanted friends", "a brave little mouse"]),
    ("Give me five tips for {}.", [
        "staying focused while working from home", "keeping a small garden", "making new friends at school",
        "cooking with kids", "traveling on a budget", "writing a good story", "learning to ski", "staying cool in summer",
        "a job interview by video call", "teaching a child to read", "a long bike ride", "looking after a puppy",
        "running a meeting", "saving water at home", "remembering what I read", "cleaning the bathroom quickly",
        "a first camping trip", "taking notes in class", "eating healthy on a budget", "packing a suitcase"]),
    ("What happens when {}?", [
        "water boils", "we sleep", "a star dies", "a volcano erupts", "ice melts", "we exercise", "bread is baked",
        "milk is heated", "a caterpillar forms a cocoon", "we get a fever", "the Moon passes in front of the Sun",
        "a bee stings", "the body gets dehydrated", "a tree loses its leaves", "a battery runs out",
        "two magnets meet", "lightning hits a tree", "salt is added to water", "we hold our breath", "a glacier melts"]),
    ("Give me an example of {}.", [
        "a metaphor", "a simile", "a palindrome", "a haiku", "a compound word", "a renewable resource",
        "a chemical change", "a physical change", "an opinion and a fact", "a prime number bigger than 50",
        "a mammal that lays eggs", "a bird of prey", "a good password", "a polite refusal", "a rhyming couplet",
        "an idiom", "a question to ask at a job interview", "an open question", "a healthy lunch", "a cold-blooded animal"]),
    ("Plan {}.", [
        "a one-day visit to Paris", "a healthy week of dinners", "a child's birthday party at home",
        "a morning routine for a student", "a weekend of hiking in the mountains", "a study schedule for exams",
        "a picnic for six people", "a small wedding in a garden", "a three-day trip to Rome",
        "a workout week for a beginner", "a garage sale", "a movie night with friends", "a school science day",
        "a cleaning schedule for a shared flat", "a road trip along the coast"]),
    ("What should I {}?", [
        "cook for dinner tonight", "pack for a week in London", "read next if I liked Harry Potter",
        "bring to a potluck", "wear to a job interview", "plant in a shady garden", "do on a day off",
        "buy a ten-year-old for a birthday", "eat before a run", "learn first as a new programmer",
        "do if my computer is slow", "do if I lose my passport abroad", "say in a wedding toast",
        "put in a first aid kit", "look for in a new apartment"]),
    ("Write a dialogue between {}.", [
        "a customer and a shop assistant", "a teacher and a student", "two friends planning a trip",
        "a doctor and a patient", "a cat and a dog", "a tourist and a local", "a waiter and a diner",
        "two astronauts on the Moon", "a child and a grandparent", "a detective and a witness",
        "a robot and a child", "a baker and a customer", "two neighbors about a fence", "a pilot and a passenger",
        "a job interviewer and a candidate"]),
    ("Describe {} in three sentences.", [
        "a lion", "the city of Tokyo", "a rainforest", "the game of chess", "the planet Saturn", "a bicycle",
        "the Mona Lisa", "a cup of coffee", "a summer festival", "an old castle", "a submarine", "a violin",
        "the Sahara", "a hospital", "a train journey", "a farm", "a thunderstorm", "a school library",
        "the northern lights", "a birthday cake"]),
    ("How is {} made?", [
        "cheese", "paper", "glass", "chocolate", "bread", "butter", "yogurt", "steel", "soap", "wine",
        "plastic", "a pencil", "sugar", "cotton cloth", "a candle", "olive oil", "ice cream", "honey",
        "tea", "peanut butter"]),
    ("Where does {} come from?", [
        "rain", "chocolate", "coffee", "rubber", "salt", "the word robot", "silk", "oxygen", "the tradition of birthday cakes",
        "pasta", "the potato", "the name Monday", "electricity", "wool", "the moon's light"]),
    ("What is the best way to {}?", [
        "learn math", "store fresh herbs", "clean windows", "memorize a poem", "fall asleep quickly", "cook pasta",
        "keep bread fresh", "study a new language", "start a conversation", "pack a lunch for school",
        "learn history", "prepare for a marathon", "organize photos on a computer", "wash vegetables",
        "cool down a hot room", "keep a conversation going", "learn to draw faces", "travel with a baby",
        "keep cut flowers fresh", "get rid of hiccups"]),
    ("Can you explain {}?", [
        "how airplanes stay in the air", "what a recession is", "how the brain stores memories",
        "what causes the seasons", "how a vaccine is tested", "what a light year is", "how rainbows get their colors",
        "how bees make honey", "what inflation does to savings", "how email reaches another person",
        "what a password hash is", "how a refrigerator keeps food cold", "how trees talk to each other",
        "what the greenhouse effect is", "how spiders make silk", "why the Roman Empire fell",
        "what a gene mutation is", "how a piano makes sound", "how compasses find north", "what quantum computers are"]),
    ("Write a limerick about {}.", [
        "a cat who loved cheese", "a forgetful wizard", "a dancing cow", "a sleepy owl", "a hungry goat",
        "a sailor from Spain", "a dog on a bike", "a very tall giraffe", "a teacher who sang", "a frog in a hat"]),
    ("Write a short speech about {}.", [
        "the importance of kindness", "protecting the oceans", "why reading matters", "the value of hard work",
        "the joy of music", "saving energy at school", "the power of friendship", "learning from mistakes",
        "why sport is good for everyone", "the future of space travel", "volunteering in the community",
        "the importance of sleep for students", "respecting animals", "our town's history", "courage"]),
    ("Write a product description for {}.", [
        "a bamboo toothbrush", "a smart watch", "a leather wallet", "a children's raincoat", "a yoga mat",
        "a cast iron skillet", "a pair of wireless earbuds", "an electric kettle", "a picnic basket",
        "a board game about pirates", "a desk plant", "a travel pillow", "a wool blanket", "a coffee grinder",
        "a set of colored pencils", "a garden bench", "a bike helmet", "a rice cooker", "a laptop bag", "a sun hat"]),
    ("Write a short review of {}.", [
        "a new pizza place", "a local museum", "a walking tour", "a mystery novel", "a pair of headphones",
        "a hotel by the sea", "a family comedy movie", "a cooking class", "a theme park", "a farmers market",
        "a public library", "an Italian restaurant", "a concert in the park", "a new phone", "a train journey"]),
    ("What are {}?", [
        "the main parts of a plant", "the layers of the Earth", "the phases of the Moon", "the parts of a cell",
        "the main food groups", "the stages of a butterfly's life", "the primary colors", "the states of matter",
        "the branches of government", "the parts of a computer", "the types of rock", "the senses of the body",
        "the main parts of a story", "the signs of dehydration", "the planets closest to the Sun",
        "the symptoms of a cold", "the rules of a haiku", "the parts of a flower", "the layers of the atmosphere",
        "the main organs of the body"]),
    ("How long does it take to {}?", [
        "boil an egg", "learn a new language", "fly from London to New York", "grow a tomato plant",
        "digest a meal", "run a marathon", "build a house", "read a novel", "bake a loaf of bread",
        "walk a mile", "charge an electric car", "get to the Moon", "learn to play the piano",
        "heal a broken arm", "form a habit"]),
    ("What is the history of {}?", [
        "the bicycle helmet", "ice skating", "the teddy bear", "the sandwich", "chess", "the Olympic torch",
        "the alphabet", "maps", "glasses", "the toothbrush", "pizza", "the dictionary", "the clock", "the compass",
        "soap", "the fork", "kites", "the library", "the theater", "basketball"]),
    ("Give me a list of {}.", [
        "fun things to do in winter", "questions to ask a new friend", "healthy breakfast foods",
        "easy houseplants", "classic children's books", "ways to reduce plastic waste", "indoor games for kids",
        "famous inventions", "things to see in London", "good habits for students", "summer fruits",
        "words that describe happiness", "items for an emergency kit", "dog breeds for families",
        "songs for a road trip", "ways to say thank you", "hobbies to try this year", "things to do at the beach",
        "foods high in protein", "kitchen safety rules"]),
    ("Rewrite this in a friendly tone: {}", [
        "Your order is delayed.", "The pool is closed today.", "Please submit the form by Friday.",
        "We do not accept cash.", "Meeting moved to 3 pm.", "No food in the library.", "Your subscription has expired.",
        "Parking is not allowed here.", "The class is full.", "Please wait to be seated."]),
    ("Turn this into a question: {}", [
        "The train leaves at six.", "She likes green tea.", "They live in Madrid.", "The shop opens on Sunday.",
        "He plays the drums.", "The museum is free today.", "We are going to the beach.",
        "The cake is in the oven.", "You finished the report.", "It will rain tomorrow."]),
    ("Write a short text message {}.", [
        "telling a friend I will be late", "asking my neighbor to feed my cat", "inviting my team to lunch",
        "wishing my dad a happy birthday", "asking a coworker for the meeting notes", "thanking a friend for dinner",
        "telling my family I arrived safely", "asking a friend to go running", "canceling plans politely",
        "reminding my sister about mom's birthday"]),
    ("Tell me something interesting about {}.", [
        "octopuses", "the Roman roads", "the deep sea", "Saturn's rings", "sloths", "ancient Egypt",
        "the human heart", "the Amazon river", "hummingbirds", "Venice", "the first computers",
        "the Great Wall of China", "volcanoes in Iceland", "sea turtles", "the Vikings' ships"]),
    ("What is the role of {}?", [
        "the heart", "the liver", "the lungs", "a referee", "a mayor", "a central bank", "the United Nations",
        "a school board", "white blood cells", "the roots of a plant", "a captain on a ship", "a museum",
        "a newspaper editor", "a conductor in an orchestra", "the kidneys"]),
    ("How do {}?", [
        "birds know where to migrate", "plants drink water", "fish sleep", "bats find their way in the dark",
        "chameleons change color", "ants find food", "camels survive in the desert", "bees find flowers",
        "snakes move without legs", "whales communicate", "seeds travel", "penguins stay warm",
        "frogs catch flies", "owls turn their heads so far", "trees grow so tall"]),
]


def content_words(text: str) -> set[str]:
    stop = {"a", "an", "the", "of", "to", "in", "on", "and", "or", "is", "are", "do", "does", "how", "what",
            "why", "who", "me", "my", "i", "you", "for", "with", "it", "its", "this", "that", "about", "give",
            "write", "tell", "explain", "describe", "short", "simple", "terms", "make", "can", "be", "was",
            "were", "which", "some", "good", "five", "three", "four", "list", "name"}
    return {w for w in re.findall(r"[a-z']+", text.lower()) if w not in stop}


def build(shipped: dict, kinds: list[tuple[str, list[str]]] = KINDS,
          taken: tuple[str, ...] = ()) -> tuple[list[str], list[tuple[str, str]]]:
    """(the prompts kept, in order; (dropped prompt, the held-out prompt it overlapped)). `taken`:
    prompts already in another training file, dropped as repeats."""
    held = shipped["held_out"]
    seen = set(shipped["train"]) | set(held)
    taken = set(taken)
    held_words = [(h, content_words(h)) for h in held]
    kept, dropped = [], []
    for template, fillers in kinds:
        for f in fillers:
            p = template.format(f)
            if p in seen or p in taken:
                dropped.append((p, "a shipped prompt" if p in seen else "a prompt of " + OUT.name))
                continue
            w = content_words(p)
            near = next((h for h, hw in held_words if w and len(w & hw) / len(w | hw) >= 0.5), None)
            if near is not None:
                dropped.append((p, near))
                continue
            seen.add(p)
            kept.append(p)
    return kept, dropped


def build_set(shipped: dict, which: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Set 1 (KINDS, drafter_prompts_more.json) or set 2 (KINDS_2, drafter_prompts_more2.json,
    without set 1's prompts)."""
    if which == 1:
        return build(shipped)
    return build(shipped, KINDS_2, taken=tuple(build(shipped)[0]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", type=int, default=1, choices=(1, 2),
                    help="1: drafter_prompts_more.json (default); 2: drafter_prompts_more2.json (new templates "
                         "and topics, none of set 1's prompts)")
    ap.add_argument("--out", type=Path, default=None, help="default: the set's file beside this script")
    a = ap.parse_args(argv)
    out = a.out or (OUT if a.set == 1 else OUT2)
    shipped = json.loads((HERE / "drafter_prompts.json").read_text())
    kept, dropped = build_set(shipped, a.set)
    about = ("More training prompts for tpumk's SmolLM2-135M-Instruct drafter (issue 56), rendered by "
             "benchmarks/drafter_more_prompts.py (templates x topics). Training only: none equals a prompt of "
             "drafter_prompts.json or overlaps a held-out prompt's content words by Jaccard >= 0.5.")
    if a.set == 2:
        about = about.replace(".py (", ".py --set 2 (").replace(">= 0.5.", f">= 0.5, nor repeats a prompt of {OUT.name}.")
    doc = {"about": about, "train": kept}
    a.out = out
    fd, tmp = tempfile.mkstemp(dir=a.out.parent, prefix=f".{a.out.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, a.out)
    for p, h in dropped:
        print(f"dropped {p!r} (near {h!r})")
    print(f"wrote {a.out}: {len(kept)} prompts")


if __name__ == "__main__":
    main()
